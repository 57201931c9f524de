"""slim_wheel.py WHEEL OUTDIR PREFIX...: copy WHEEL into OUTDIR without the members whose names start
with any PREFIX, rewriting RECORD (hashes of what is kept) so that pip installs it."""
import base64
import hashlib
import os
import sys
import zipfile

src, outdir, drop = sys.argv[1], sys.argv[2], tuple(sys.argv[3:])
dst = os.path.join(outdir, os.path.basename(src))
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    record, kept = None, []
    for info in zin.infolist():
        if info.filename.endswith(".dist-info/RECORD"):
            record = info.filename
            continue
        if info.filename.startswith(drop):
            print("dropped", info.filename, info.file_size)
            continue
        data = zin.read(info.filename)
        zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        kept.append(f"{info.filename},sha256={digest},{len(data)}")
    zout.writestr(record, "\n".join(kept + [f"{record},,"]) + "\n")
print("wrote", dst, os.path.getsize(dst))
