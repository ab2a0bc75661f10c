"""The health response the client decodes by hand (mlaverify._wire): fields
it does not know are skipped whatever their wire type, so a server whose
HealthCheckResponse grew a field still answers every client; input that
is not protobuf (cut short, wire types 3, 4, 6, 7, field 0) raises
ValueError."""

import struct

import pytest

from mlaverify._wire import decode_health


def varint(n):
    n &= (1 << 64) - 1  # negative numbers as protobuf sends them: 10 bytes
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(number, wire_type, payload):
    return varint(number << 3 | wire_type) + payload


def status(value):
    return field(1, 0, varint(value))


# One unknown field of each wire type (and a field number whose tag takes
# more than one byte).
UNKNOWN = {
    "varint": field(2, 0, varint(300)),
    "varint, field 1000": field(1000, 0, varint(1 << 40)),
    "64-bit": field(3, 1, struct.pack("<d", 1.5)),
    "length-delimited": field(4, 2, varint(5) + b"hello"),
    "length-delimited, empty": field(5, 2, varint(0)),
    "nested message": field(6, 2, varint(4) + field(1, 0, varint(3)) + field(2, 0, varint(1))),
    "32-bit": field(7, 5, struct.pack("<f", 2.5)),
}


def test_status_alone():
    assert decode_health(status(1)) == "SERVING"
    assert decode_health(status(2)) == "NOT_SERVING"
    assert decode_health(b"") == "UNKNOWN"  # proto3: status 0 is not sent
    assert decode_health(status(9)) == "UNKNOWN(9)"
    assert decode_health(status(-1)) == "UNKNOWN(-1)"  # int32 sign-extended to 10 bytes


@pytest.mark.parametrize("kind", sorted(UNKNOWN))
def test_unknown_fields_are_skipped_around_the_status(kind):
    extra = UNKNOWN[kind]
    assert decode_health(extra + status(1)) == "SERVING"
    assert decode_health(status(2) + extra) == "NOT_SERVING"
    assert decode_health(extra + status(1) + extra) == "SERVING"
    assert decode_health(extra) == "UNKNOWN"


def test_every_unknown_field_together():
    body = b"".join(UNKNOWN.values())
    assert decode_health(body + status(1) + body) == "SERVING"


def test_the_last_status_wins():
    assert decode_health(status(2) + UNKNOWN["32-bit"] + status(1)) == "SERVING"


def test_field_1_of_another_wire_type_is_not_the_status():
    # A parser of this message keeps it as unknown; the status stays as sent.
    assert decode_health(status(1) + field(1, 2, varint(1) + b"\x02")) == "SERVING"
    assert decode_health(status(1) + field(1, 5, b"\x02\x00\x00\x00")) == "SERVING"


def test_every_cut_inside_a_field_raises():
    parts = [UNKNOWN["varint, field 1000"], UNKNOWN["64-bit"], status(1),
             UNKNOWN["length-delimited"], UNKNOWN["32-bit"]]
    message = b"".join(parts)
    ends = {0}
    for p in parts:
        ends.add(max(ends) + len(p))
    for cut in range(len(message)):
        if cut in ends:
            decode_health(message[:cut])  # whole fields: decodes
            continue
        with pytest.raises(ValueError, match="truncated"):
            decode_health(message[:cut])


@pytest.mark.parametrize("wire_type", [3, 4, 6, 7])
def test_wire_types_protobuf_does_not_send_raise(wire_type):
    with pytest.raises(ValueError, match=f"wire type {wire_type}"):
        decode_health(status(1) + field(2, wire_type, b"\x00" * 8))


def test_field_number_0_and_overlong_varints_raise():
    with pytest.raises(ValueError, match="field number 0"):
        decode_health(field(0, 0, varint(1)))
    with pytest.raises(ValueError, match="longer than 10 bytes"):
        decode_health(b"\x08" + b"\xff" * 10 + b"\x01")
