"""The random-weight Llamas that ../shared/peers compares engines on, built reproducibly.

    python benchmarks/make_peer_models.py SMOLLM2_DIR OUT_DIR [--size 7m|125m]

Hidden 256, 4 layers, 4 query / 2 KV heads of 64, MLP 768, vocabulary 8192 (7.34M
parameters, float32, seed 0), with SmolLM2's byte-level BPE tokenizer cut to its first 8192
tokens (merges that make a later token dropped), so that `offline_compare.py`'s token ids
(< 8192) and `vllm bench serve`'s random prompts (drawn from the tokenizer) are all valid
for every engine. SMOLLM2_DIR is the float32 folder ../shared/peers/setup.sh makes.

`--size 125m` (issue 36's "125M random Llama"): hidden 768, 12 layers, 12 query / 12 KV heads
of 64 (multi-head, as GPT-2 / OPT-125M and the earlier `tidal bench --random-weights 768,12`
model), MLP 3072, the same cut tokenizer (125.8M parameters).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

VOCAB = 8192

# LlamaConfig fields per --size (vocabulary, tokenizer, seed and dtype are common)
SIZES = {
    "7m": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2),
    "125m": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=12),
}


def cut_tokenizer(src: str, dst: str, vocab_size: int = VOCAB) -> None:
    tj = json.load(open(os.path.join(src, "tokenizer.json")))
    vocab = {t: i for t, i in tj["model"]["vocab"].items() if i < vocab_size}
    merges = []
    for merge in tj["model"]["merges"]:
        a, b = merge.split(" ") if isinstance(merge, str) else merge
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(merge)
    tj["model"]["vocab"], tj["model"]["merges"] = vocab, merges
    tj["added_tokens"] = [t for t in tj["added_tokens"] if t["id"] < vocab_size]
    json.dump(tj, open(os.path.join(dst, "tokenizer.json"), "w"))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))


def main(argv=None) -> int:
    import torch
    import transformers

    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("smollm2_dir"), ap.add_argument("out_dir")
    ap.add_argument("--size", choices=sorted(SIZES), default="7m")
    a = ap.parse_args(argv)
    src, dst = a.smollm2_dir, a.out_dir
    os.makedirs(dst, exist_ok=True)
    cut_tokenizer(src, dst)
    tok = transformers.AutoTokenizer.from_pretrained(dst)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, **SIZES[a.size], max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(dst, safe_serialization=True)
    print(f"{dst}: {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"tokenizer of {len(tok)} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
