"""Averaging payloads: the 8-bit blockwise codec (wire format ``protocols/codec.v1.md``), error feedback."""

from peerd.averaging.codec import Scheme, decode, encode
from peerd.averaging.feedback import encode_with_feedback

__all__ = ["Scheme", "decode", "encode", "encode_with_feedback"]
