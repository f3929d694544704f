"""Quality of each quantized format on the real SmolLM2-135M against float32, for the docs:
`python -m tests.engine.quant.measure_quality` (CPU, a few minutes). Writes each checkpoint
with compressed-tensors (min-max scales, as in the tests) and online FP8 at load, then prints
mean KL, top-1 agreement and perplexity on tests/data/english_text.txt, and the weights' size."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from kvbatch.engine.model.loader import load_model
from kvbatch.fetch import smollm2_dir
from tests.engine.quant import ct_checkpoints
from tests.engine.quant.quality import agreement_on_text

TEXT = Path(__file__).parents[2] / "data" / "english_text.txt"
SCHEMES = ("fp8-dynamic", "fp8-static", "int8-w8a8", "w8a16", "w4a16", "w4a16-asym")


def main() -> None:
    source = smollm2_dir()
    cpu = torch.device("cpu")
    reference = load_model(source, torch.float32, cpu)
    ids = reference.tokenizer.encode(TEXT.read_text())
    rows = [("float32", reference)]
    rows.append(("online fp8", load_model(source, torch.float32, cpu, quantization="fp8")))
    with tempfile.TemporaryDirectory() as tmp:
        for scheme in SCHEMES:
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
            path = ct_checkpoints.quantize_and_save(model, scheme, Path(tmp) / scheme)
            rows.append((f"compressed-tensors {scheme}", load_model(path, torch.float32, cpu)))
        print(f"SmolLM2-135M-Instruct, {len(ids)} tokens of text, CPU float32 activations")
        print("| weights | MiB | mean KL (nats) | top-1 agreement | perplexity |")
        print("|---|---|---|---|---|")
        for name, loaded in rows:
            q = agreement_on_text(reference.model, loaded.model, ids)
            mib = loaded.weight_bytes / 2**20
            print(
                f"| {name} | {mib:.0f} | {q.mean_kl:.4f} | {q.top1_agreement:.3f} | "
                f"{q.perplexity:.2f} |"
            )
            sys.stdout.flush()


if __name__ == "__main__":
    main()
