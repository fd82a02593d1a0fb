"""Client side of the control endpoint, for `peerd status` and scripts."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from peerd.errors import ControlError


def normalize_url(control: str) -> str:
    """Accepts ``http://host:port``, ``host:port`` or a bare port."""
    control = control.strip()
    if control.isdigit():
        return f"http://127.0.0.1:{control}"
    if "://" not in control:
        return f"http://{control}"
    return control.rstrip("/")


def fetch_status(control: str, timeout: float = 5.0) -> dict[str, Any]:
    return fetch_json(control, "/status", timeout)


def fetch_json(control: str, path: str, timeout: float = 5.0) -> dict[str, Any]:
    """The JSON object the daemon at ``control`` serves at ``path`` (``/status``, ``/history?points=N``)."""
    url = normalize_url(control) + path
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            data = json.load(response)
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        reason = getattr(e, "reason", e)
        raise ControlError(
            f"no peerd daemon answered at {url} ({reason}); is it running? Pass the `control` address from "
            "its ready line with --control",
            address=url,
        ) from e
    except json.JSONDecodeError as e:
        raise ControlError(f"{url} did not return JSON; is that a peerd control endpoint?", address=url) from e
    if not isinstance(data, dict):
        raise ControlError(f"{url} returned unexpected JSON", address=url)
    return data
