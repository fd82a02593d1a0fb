"""What every peerd protocol shares, below averaging, experts and state transfer: length-prefixed frames with
limits (frames.py), the 8-bit blockwise codec (codec.py, wire format ``protocols/codec.v1.md``) and error
feedback around it (feedback.py)."""

from peerd.wire.codec import Scheme, decode, encode
from peerd.wire.feedback import encode_with_feedback

__all__ = ["Scheme", "decode", "encode", "encode_with_feedback"]
