#!/usr/bin/env python3
"""Every tensor of every golden file loads in place with torch.frombuffer: the
file's bytes as uint8, sliced at the tensor's offsets and viewed as its dtype
(which needs the data aligned to the element size), equal to what a plain reader
gets.

    /usr/bin/python3 tests/verify/golden_frombuffer.py GOLDEN_DIR...
"""
import glob
import json
import os
import struct
import sys

import numpy as np
import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "I64": torch.int64,
          "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def main(folders):
    loaded = 0
    for folder in folders:
        for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
            data = bytearray(open(path, "rb").read())
            (n,) = struct.unpack("<Q", data[:8])
            header = json.loads(data[8:8 + n])
            whole = torch.frombuffer(data, dtype=torch.uint8)
            for key, entry in header.items():
                if key == "__metadata__":
                    continue
                begin, end = (8 + n + o for o in entry["data_offsets"])
                t = whole[begin:end].view(DTYPES[entry["dtype"]]).reshape(entry["shape"])
                if entry["dtype"] != "BF16":
                    plain = np.frombuffer(bytes(data[begin:end]), dtype=t.numpy().dtype).reshape(entry["shape"])
                    assert np.array_equal(t.numpy(), plain, equal_nan=True), "%s %s: values differ" % (path, key)
                loaded += 1
    print("golden_frombuffer: %d tensors load in place" % loaded)
    return 0 if loaded else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
