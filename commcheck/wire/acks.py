"""Acknowledgements: the collector's answer naming the messages it committed (``(pid, seq)``
pairs), read by whatever sent them. The delivery protocol is described in
:mod:`commcheck.collector.ledger`."""

from __future__ import annotations

import msgspec

_ack_encoder = msgspec.msgpack.Encoder()
_ack_decoder = msgspec.msgpack.Decoder(list[tuple[int, int]])


def encode_acks(names: list[tuple[int, int]]) -> bytes:
    return _ack_encoder.encode(names)


def decode_acks(data: bytes) -> list[tuple[int, int]]:
    try:
        return _ack_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return []
