#!/usr/bin/env python3
"""Benchmark ``shardkit convert`` (zip pickle, DCP and GGUF sources; GGUF out) and ``shardkit verify``, in one run:
groups of shell cases, each against its own floor (:func:`unet_groups`, :func:`gguf_group`).
Method: docs/benchmarks.md, "How each benchmark measures".

    .venv/bin/python scripts/bench_convert.py --runs 3            # SD 1.5 UNet
    .venv/bin/python scripts/bench_convert.py --large --runs 3    # SDXL UNet
    .venv/bin/python scripts/bench_convert.py --groups gguf --runs 3
    .venv/bin/python scripts/bench_convert.py --groups gguf --layers 1 --runs 1   # ~0.2 GB, to check the script
    .venv/bin/python scripts/bench_convert.py --groups gguf-out --sizes 4,10,20 --runs 3
    .venv/bin/python scripts/bench_convert.py --groups gguf-out --sizes 1 --runs 1   # ~0.3 GB, to check the script
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from shlex import quote
from statistics import median

import benchlib
from benchlib import SK, Case, tree_bytes
from build_checkpoint import DCP_SAVE, TORCH_SAVE, build_once, random_source, unet_source

# Child-process code reading the files sys.argv[1:] (as ``verify`` must): a plain loop, or sha256 on one thread.
READ_LOOP = ("import mmap, os, sys\nview = memoryview(mmap.mmap(-1, 1 << 20))\nfor p in sys.argv[1:]:\n"
             "    fd = os.open(p, os.O_RDONLY)\n    while os.readv(fd, [view]): pass\n    os.close(fd)")
SHA256 = "import hashlib, sys\nfor p in sys.argv[1:]:\n    hashlib.file_digest(open(p, 'rb'), 'sha256')"
BIN = os.path.dirname(sys.executable)
# Child-process code writing a Llama-shaped Q4_0 GGUF of sys.argv[1] layers at sys.argv[2].
GGUF_BUILD = """
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

# Child-process code: the incumbent GGUF → bf16 safetensors (sys.argv[1] → sys.argv[2]).
INCUMBENT = ("import sys, numpy as np, torch, gguf; from safetensors.torch import save_file; "
             "r = gguf.GGUFReader(sys.argv[1]); "
             "sd = {t.name: torch.from_numpy(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape("
             "[int(d) for d in reversed(t.shape)])).to(torch.bfloat16) for t in r.tensors}; "
             "save_file(sd, sys.argv[2])")


def unet_groups(kind: str, work: str) -> dict[str, list[Case]]:
    """The UNet groups' cases (inputs built once), the floor first; named with the input's size."""
    src = unet_source(kind, work)
    pkl = build_once(os.path.join(work, f"{kind}-unet.bin"), TORCH_SAVE, src, hide_stderr=True)
    dcp = build_once(os.path.join(work, f"{kind}-unet-dcp"), DCP_SAVE, src, "0", hide_stderr=True)
    sharded = os.path.join(work, f"{kind}-unet-5GB")
    if not os.path.exists(sharded):
        subprocess.run([os.path.join(BIN, "shardkit"), "split", src, sharded, "--max-shard-size", "2GB", "-q"],
                       check=True)
    out, py = os.path.join(work, "out"), quote(sys.executable)
    q_out, target = quote(out), "≤ 1.5× cp, ≤ 1 GB"
    hub = (f"{quote(sys.executable)} -c \"import torch; from huggingface_hub import save_torch_state_dict; "
           f"save_torch_state_dict(torch.load('{pkl}', weights_only=True, mmap=True), '{out}', max_shard_size='5GB')\"")
    shards = " ".join(quote(p) for p in sorted(os.path.join(sharded, f) for f in os.listdir(sharded)))
    return {
        f"bin ({tree_bytes(pkl) / 1e9:.2f} GB)": [
            Case("cp .bin (floor)", f"mkdir -p {q_out} && cp {quote(pkl)} {q_out}/ && sync", cleanup=[out]),
            Case("shardkit convert .bin 5GB", f"{SK} convert {quote(pkl)} {q_out} --max-shard-size 5GB -q && sync",
                 target, [out]),
            Case("torch.load(mmap) + hub save_torch_state_dict", f"mkdir -p {q_out} && {hub} && sync", "incumbent",
                 [out])],
        f"dcp ({tree_bytes(dcp) / 1e9:.2f} GB)": [
            Case("cp -r DCP (floor)", f"cp -r {quote(dcp)} {q_out} && sync", cleanup=[out]),
            Case("shardkit convert DCP 5GB", f"{SK} convert {quote(dcp)} {q_out} --max-shard-size 5GB -q && sync",
                 target, [out]),
            Case("accelerate merge-weights", f"{quote(os.path.join(BIN, 'accelerate'))} merge-weights {quote(dcp)} "
                 f"{q_out} >/dev/null 2>&1 && sync", "incumbent (one file)", [out])],
        f"verify ({tree_bytes(sharded) / 1e9:.2f} GB)": [
            Case("cat shards > /dev/null (floor, warm)", f"cat {shards} > /dev/null"),
            Case("read loop (1 MiB readv)", f"{py} -c {quote(READ_LOOP)} {shards}"),
            Case("hashlib.file_digest sha256 (1 thread)", f"{py} -c {quote(SHA256)} {shards}"),
            Case("shardkit verify", f"{SK} verify {quote(sharded)} -q", "≥ 0.8× cat speed"),
            Case("shardkit verify of the single file", f"{SK} verify {quote(src)} -q"),
            Case("shardkit verify --against the single file", f"{SK} verify {quote(sharded)} --against {quote(src)} -q",
                 "reads both")],
    }


def gguf_group(layers: int, work: str) -> dict[str, list[Case]]:
    src = build_once(os.path.join(work, f"llama-{layers}l-q4_0.gguf"), GGUF_BUILD, str(layers))
    out = os.path.join(work, "gguf-out")
    q_src, q_out = quote(src), quote(out)
    return {f"gguf (Llama-shaped Q4_0, {layers} layers, {tree_bytes(src) / 1e9:.2f} GB)": [
        Case("cp .gguf (floor)", f"mkdir -p {q_out} && cp {q_src} {q_out}/ && sync", cleanup=[out]),
        Case("shardkit convert --dtype bf16", f"{SK} convert {q_src} {q_out} --dtype bf16 -q && sync", "≤ 500 MB",
             [out]),
        Case("gguf dequantize + save_file (incumbent)", f"mkdir -p {q_out} && {quote(sys.executable)} -c "
             f"{quote(INCUMBENT)} {q_src} {q_out}/model.safetensors && sync", "incumbent", [out])]}


# The TinyLlama shape the earlier hand measurement used (docs/quantized.md): 10 layers are 1.14 GB of bf16.
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
         "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
         "rope_theta": 10000.0, "vocab_size": 32000, "bos_token_id": 0, "eos_token_id": 2, "hidden_act": "silu",
         "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# Child-process code: shardkit's CLI (sys.argv[2:]) with the tiny tokenizer's probe hash (sys.argv[1]) taken as gpt-2.
SHARDKIT_PRE = ("import runpy, sys; from shardkit.layouts import gguf_pre; gguf_pre.PRE_TOKENIZERS[sys.argv[1]] = 'gpt-2'; "
                "sys.argv = ['shardkit', *sys.argv[2:]]; runpy.run_module('shardkit', run_name='__main__', alter_sys=True)")
# Child-process code: "identical" when the GGUF files sys.argv[1:3] are, "tensors and keys" when every tensor (type,
# shape, bytes) and every key but general.* are; otherwise it fails naming the first difference.
SAME_GGUF = """
import filecmp, sys, numpy as np, gguf
a, b = sys.argv[1:3]
if filecmp.cmp(a, b, shallow=False):
    print("identical"); sys.exit(0)
ra, rb = gguf.GGUFReader(a), gguf.GGUFReader(b)
ta, tb = {t.name: t for t in ra.tensors}, {t.name: t for t in rb.tensors}
if sorted(ta) != sorted(tb):
    sys.exit(f"tensor names differ: {sorted(set(ta) ^ set(tb))[:5]}")
for name, t in ta.items():
    u = tb[name]
    if (t.tensor_type, list(t.shape)) != (u.tensor_type, list(u.shape)) or \
            np.asarray(t.data).tobytes() != np.asarray(u.data).tobytes():
        sys.exit(f"tensor {name} differs")
def keys(r):
    return {k: (f.types, f.contents()) for k, f in r.fields.items() if not k.startswith(("GGUF.", "general."))}
if keys(ra) != keys(rb):
    sys.exit(f"keys differ: {sorted(k for k in set(keys(ra)) | set(keys(rb)) if keys(ra).get(k) != keys(rb).get(k))[:5]}")
print("tensors and keys")
"""


def llama_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    """The tensors of a :data:`LLAMA` of ``layers`` layers, as transformers names them."""
    h, i, v = LLAMA["hidden_size"], LLAMA["intermediate_size"], LLAMA["vocab_size"]
    kv = h // LLAMA["num_attention_heads"] * LLAMA["num_key_value_heads"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
                                          "lm_head.weight": (v, h)}
    for n in range(layers):
        p = f"model.layers.{n}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)})
    return shapes


def build_llama_folder(folder: str, layers: int) -> str:
    """A bf16 :data:`LLAMA` folder of ``layers`` layers (random weights streamed into 500 MB shards, config.json,
    the tiny BPE tokenizer); returns the tokenizer's probe hash."""
    from helpers_llama_cpp import tiny_bpe_tokenizer  # tests/ (on sys.path through benchlib)

    import shardkit
    from shardkit.layouts.gguf_vocab import probe_hash

    benchlib.remove(folder)
    shardkit.split(random_source(llama_shapes(layers), dtype="BF16"), folder, max_shard_size="500MB", manifest=False)
    Path(folder, "config.json").write_text(json.dumps({**LLAMA, "num_hidden_layers": layers}, indent=2))
    tiny_bpe_tokenizer(Path(folder))
    return probe_hash(os.path.join(folder, "tokenizer.json"))


def gguf_out_sweep(sizes: list[int], work: str, *, runs: int) -> str:
    """For each layer count: build the folder, run shardkit and the converter interleaved, check their outputs equal,
    delete it all; the report (markdown)."""
    from helpers_llama_cpp import llama_cpp_converter  # the converter and its wrapper, from tests/

    converter = llama_cpp_converter()
    wrapper, py = quote(str(converter.with_name("wrapper.py"))), quote(sys.executable)
    rows, loads = [], []
    for layers in sizes:
        folder, ours, theirs = (os.path.join(work, f"llama-{layers}l-bf16{s}") for s in ("", ".sk.gguf", ".ref.gguf"))
        print(f"building {folder} ...", flush=True)
        digest = build_llama_folder(folder, layers)
        cases = [Case("shardkit", f"rm -f {quote(ours)} && {py} -c {quote(SHARDKIT_PRE)} {digest} convert "
                      f"{quote(folder)} {quote(ours)} --to gguf --quantize q8_0 -q && sync"),
                 Case("converter", f"rm -f {quote(theirs)} && env -u NO_LOCAL_GGUF PRE_FALLBACK=gpt-2 {py} {wrapper} "
                      f"{quote(str(converter))} {quote(folder)} --outfile {quote(theirs)} --outtype q8_0 "
                      ">/dev/null 2>&1 && sync")]
        benchlib.run_interleaved(cases, runs=runs, loads=loads)
        same = subprocess.run([sys.executable, "-c", SAME_GGUF, ours, theirs], capture_output=True, text=True)
        verdict = same.stdout.strip() if same.returncode == 0 else f"DIFFER: {same.stderr.strip()[-200:]}"
        rows.append(gguf_out_row(layers, tree_bytes(folder), cases, verdict))
        for path in (folder, ours, theirs):
            benchlib.remove(path)
    head = ["layers (bf16 GB)", "shardkit wall s", "CPU s", "peak RSS MB", "converter wall s", "CPU s", "peak RSS MB",
            "ratios (wall, CPU, RSS)", "outputs"]
    return (benchlib.report_head("bf16 folder → GGUF q8_0, each write followed by sync", runs=runs, loads=loads)
            + benchlib.markdown(head, rows, align="l" + "r" * 7 + "l") + "\n")


def gguf_out_row(layers: int, size_bytes: int, cases: list[Case], verdict: str) -> list[str]:
    sk, ref = ({"wall": median(c.times), "cpu": median(c.cpu_s), "rss": max(c.rss_mb)} for c in cases)
    ratios = ", ".join(f"{sk[k] / ref[k]:.2f}" for k in ("wall", "cpu", "rss"))
    return [f"{layers} ({size_bytes / 1e9:.2f} GB)", f"{sk['wall']:.1f}", f"{sk['cpu']:.1f}", f"{sk['rss']:.0f}",
            f"{ref['wall']:.1f}", f"{ref['cpu']:.1f}", f"{ref['rss']:.0f}", ratios, verdict]


def main() -> int:
    p = benchlib.parser(__doc__, work="bench-data")
    p.add_argument("--large", action="store_true", help="SDXL UNet (~10.3 GB) instead of SD 1.5 (~3.4 GB)")
    p.add_argument("--tiny", action="store_true", help="a few MB, to check the script itself")
    p.add_argument("--groups", default="bin,dcp,verify", help="which of bin, dcp, verify and gguf (comma-separated), or gguf-out alone")
    p.add_argument("--layers", type=int, default=9, help="gguf: the Llama's layers (9: ~1.04 GB of Q4_0)")
    p.add_argument("--sizes", default="4,10,20", help="gguf-out: the bf16 Llamas' layer counts (10: ~1.14 GB)")
    args = p.parse_args()
    kind, wanted = "tiny" if args.tiny else "sdxl" if args.large else "sd15", args.groups.split(",")
    os.makedirs(args.work, exist_ok=True)
    if "gguf-out" in wanted:
        if len(wanted) > 1:
            p.error("--groups gguf-out runs alone (its report is a size sweep)")
        sizes = [int(n) for n in args.sizes.split(",")]
        benchlib.publish_report(gguf_out_sweep(sizes, args.work, runs=args.runs), args.output)
        return 0
    unet = set(wanted) - {"gguf"}
    tables = {name: cases for name, cases in (unet_groups(kind, args.work) if unet else {}).items()
              if name.split()[0] in wanted}
    tables.update(gguf_group(args.layers, args.work) if "gguf" in wanted else {})
    benchlib.shell_bench("convert benchmark" + (f": {kind} UNet" if unet else ""), tables, runs=args.runs, output=args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
