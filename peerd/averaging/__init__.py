"""Averaging: the payload codec (8-bit blockwise quantization, wire format ``protocols/codec.v1.md``) and error
feedback for it."""

from peerd.averaging.codec import Scheme, decode, encode
from peerd.averaging.feedback import ErrorFeedback, encode_with_feedback

__all__ = ["ErrorFeedback", "Scheme", "decode", "encode", "encode_with_feedback"]
