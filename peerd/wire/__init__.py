"""What every peerd protocol shares, below averaging, experts and state transfer: length-prefixed frames with
limits (frames.py), the 8-bit blockwise codec (codec.py, wire format ``protocols/codec.v1.md``) and error
feedback around it (feedback.py), the membership handshake (membership.py, handshake.py, guard.py), and the
requests to p2pd's control socket made past hivemind's API (p2pd_control.py).

Import from the modules: the codec needs torch, which a light peer (frames and membership only) never loads."""

__all__: list[str] = []
