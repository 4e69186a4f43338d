"""Peak memory of attention inside a padded Llama, beyond the model's own.

Each run is a fresh process (its peak resident set is its own): a 1-layer Llama (hidden 64,
4 query heads over 2 key/value heads) in float32, batch 2 at L tokens, the first sequence
left-padded by L/4, one forward and backward. "none" replaces attention by a copy of the
query, so its peak is the model's own; each implementation's peak less that one is what
its attention (and its mask) adds.

    python benchmarks/transformers_memory.py [--length 4096] [--docs docs/bench.md]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from attngrad.machine import cpu_name

IMPLEMENTATIONS = ("none", "attngrad", "sdpa", "eager")


def one_run(implementation: str, length: int) -> dict:
    import torch
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    from attngrad.integrations.transformers import register

    register()
    if implementation == "none":  # attention's output replaced by the query: the model's own memory
        AttentionInterface.register("none", lambda module, q, k, v, mask, **_: (q.transpose(1, 2).contiguous(), None))
        AttentionMaskInterface.register("none", flash_attention_mask)  # the 2-D mask as it is
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=length)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=implementation, dtype=torch.float32)
    ids = torch.randint(1, 128, (2, length))
    padding = torch.ones(2, length, dtype=torch.long)
    padding[0, :length // 4] = 0
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model(input_ids=ids, attention_mask=padding).logits.sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return dict(implementation=implementation, peak_mib=peak / 1024, loaded_mib=before / 1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--one", choices=IMPLEMENTATIONS, help=argparse.SUPPRESS)
    parser.add_argument("--docs", type=Path, help="also write the table as this run's section of this page")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one, args.length)))
        return
    runs = {}
    for implementation in IMPLEMENTATIONS:
        done = subprocess.run([sys.executable, __file__, "--one", implementation, "--length", str(args.length)],
                              capture_output=True, text=True, check=True)
        runs[implementation] = json.loads(done.stdout.strip().splitlines()[-1])
    own = runs["none"]["peak_mib"]
    lines = [f"A padded Llama through transformers, B = 2, L = {args.length}, float32, one forward and backward; "
             f"{cpu_name()}, {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}. Peak resident memory of a "
             "fresh process each; \"none\" copies the query instead of attending (the model's own).", "",
             "| attention | peak RSS (MiB) | beyond the model's own (MiB) |", "|---|---|---|"]
    for implementation, run in runs.items():
        extra = "-" if implementation == "none" else f"{run['peak_mib'] - own:.0f}"
        lines.append(f"| {implementation} | {run['peak_mib']:.0f} | {extra} |")
    print("\n".join(lines))
    if args.docs:
        from attngrad.docs_page import write_section

        command = f"python benchmarks/transformers_memory.py --length {args.length}"
        write_section(args.docs, "benchmarks/transformers_memory.py", f"`{command}`\n\n" + "\n".join(lines), "Benchmarks")
        print(f"wrote {args.docs}")


if __name__ == "__main__":
    main()
