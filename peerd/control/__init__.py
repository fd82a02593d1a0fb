"""Local control endpoint of a daemon and its client."""

from peerd.control.client import fetch_status, normalize_url
from peerd.control.server import ControlServer

__all__ = ["ControlServer", "fetch_status", "normalize_url"]
