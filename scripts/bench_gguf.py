#!/usr/bin/env python3
"""Benchmark ``shardkit convert model.gguf out/ --dtype bf16`` (a Llama-shaped Q4_0 GGUF), in one run.

Builds (once) a Llama-7B-shaped GGUF of ``--layers`` layers (default 9: ~1.04 GB of Q4_0, random
blocks with finite f16 scales, written by ``gguf.GGUFWriter``), then runs interleaved, ``--runs``
times (median), each in a fresh process with its peak RSS:

  * ``cp`` of the GGUF (the floor for bytes moved, though a dequantizing convert writes 3.6× more);
  * ``shardkit convert ... --dtype bf16`` (HF names, q/k unpermuted, config.json);
  * the incumbent a user writes today: ``gguf.GGUFReader`` + ``gguf.quants.dequantize`` of every
    tensor into a bf16 state dict, then ``safetensors.torch.save_file`` (llama.cpp names, no permutation
    undone: less work than shardkit does).

    .venv/bin/python scripts/bench_gguf.py --runs 3
    .venv/bin/python scripts/bench_gguf.py --layers 1 --runs 1     # ~0.2 GB, to check the script
"""

from __future__ import annotations

import os
import sys
from shlex import quote

from benchlib import SK, Case, parser, shell_bench
from build_checkpoint import build_once

BUILD = """
import sys, numpy as np, gguf
from gguf import GGMLQuantizationType as T
layers, path = int(sys.argv[1]), sys.argv[2]
rng = np.random.default_rng(0)
H, I, V = 4096, 11008, 32000
w = gguf.GGUFWriter(path, "llama")
w.add_context_length(4096); w.add_embedding_length(H); w.add_block_count(layers); w.add_feed_forward_length(I)
w.add_head_count(32); w.add_head_count_kv(8); w.add_layer_norm_rms_eps(1e-5); w.add_rope_freq_base(10000.0)
w.add_rope_dimension_count(128); w.add_vocab_size(V); w.add_tokenizer_model("no_vocab")
def add(name, rows, cols):
    n = rows * cols // 32
    raw = rng.integers(0, 256, size=(n, 18), dtype=np.uint8)
    raw[:, :2] = np.frombuffer((rng.standard_normal(n) * 0.01).astype(np.float16).tobytes(), np.uint8).reshape(n, 2)
    raw = raw.reshape(rows, cols // 32 * 18)
    w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=T.Q4_0)
add("token_embd.weight", V, H)
for i in range(layers):
    w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(H, np.float32))
    w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(H, np.float32))
    for name, rows, cols in (("attn_q", H, H), ("attn_k", 1024, H), ("attn_v", 1024, H), ("attn_output", H, H),
                             ("ffn_gate", I, H), ("ffn_up", I, H), ("ffn_down", H, I)):
        add(f"blk.{i}.{name}.weight", rows, cols)
w.add_tensor("output_norm.weight", np.ones(H, np.float32))
add("output.weight", V, H)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
"""

INCUMBENT = ("import sys, numpy as np, torch, gguf; from safetensors.torch import save_file; "
             "r = gguf.GGUFReader(sys.argv[1]); "
             "sd = {t.name: torch.from_numpy(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape("
             "[int(d) for d in reversed(t.shape)])).to(torch.bfloat16) for t in r.tensors}; "
             "save_file(sd, sys.argv[2])")


def main() -> int:
    p = parser(__doc__, work="bench-data")
    p.add_argument("--layers", type=int, default=9)
    args = p.parse_args()
    os.makedirs(args.work, exist_ok=True)
    src = build_once(os.path.join(args.work, f"llama-{args.layers}l-q4_0.gguf"), BUILD, str(args.layers))
    out = os.path.join(args.work, "gguf-out")
    q_src, q_out = quote(src), quote(out)
    cases = [
        Case("cp .gguf (floor)", f"mkdir -p {q_out} && cp {q_src} {q_out}/ && sync", cleanup=[out]),
        Case("shardkit convert --dtype bf16", f"{SK} convert {q_src} {q_out} --dtype bf16 -q && sync",
             "≤ 500 MB", [out]),
        Case("gguf dequantize + save_file (incumbent)", f"mkdir -p {q_out} && {quote(sys.executable)} -c "
             f"{quote(INCUMBENT)} {q_src} {q_out}/model.safetensors && sync", "incumbent", [out]),
    ]
    shell_bench(f"GGUF convert benchmark: Llama-shaped Q4_0, {args.layers} layers, {os.path.getsize(src) / 1e9:.2f} GB",
                {"": cases}, runs=args.runs, output=args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
