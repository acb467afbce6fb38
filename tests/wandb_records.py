"""Read a wandb offline run file (.wandb) back into wandb's own protobuf Records.

wandb 0.31 no longer ships its Python datastore reader (the writer is in wandb-core), so this
walks the file's framing - a 7-byte ':W&B' header, then leveldb-log style 32 KiB blocks of
[crc32 u32, length u16, type u8] chunks (1 full, 2 first, 3 middle, 4 last) - and parses each
record with wandb.proto.wandb_internal_pb2.Record.
"""
import struct

BLOCK = 32768
HEADER = 7


def read_records(path: str) -> list:
    from wandb.proto import wandb_internal_pb2 as pb
    buf = open(path, "rb").read()
    assert buf[:4] == b":W&B", buf[:4]
    pos, out, part = HEADER, [], b""
    while pos + HEADER <= len(buf):
        left = BLOCK - pos % BLOCK
        if left < HEADER:                 # block trailer padding
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", buf[pos:pos + HEADER])
        pos += HEADER
        if n == 0 and kind == 0:          # zero-filled rest of a block
            pos += left - HEADER
            continue
        part += buf[pos:pos + n]
        pos += n
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(part)
            out.append(record)
            part = b""
    return out


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def history_and_config(path: str) -> tuple[list[dict], dict]:
    """([{key: value_json}, one per logged step], {config key: value_json})."""
    history, config = [], {}
    for r in read_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            history.append({_key(i): i.value_json for i in r.history.item})
        elif kind in ("config", "run"):
            for i in (r.config if kind == "config" else r.run.config).update:
                config[_key(i)] = i.value_json
    return history, config
