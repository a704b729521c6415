#!/usr/bin/env python3
"""An F32 GGUF of `make_peer_models.py`'s ~7M Llama for llama-server, by llama.cpp's own
converter (`convert_hf_to_gguf.py` of ../shared/peers/setup.sh's llama.cpp checkout).

The converter names the pre-tokenizer by hashing what the tokenizer makes of a test text, and
a vocabulary cut to 8192 tokens hashes to nothing it knows. Its pre-tokenizer is SmolLM2's,
unchanged (byte-level BPE, the same `pre_tokenizer` in tokenizer.json: checked below), so the
converter is told "smollm", the name it gives SmolLM2 itself.

    ~/.cache/tidal-peers/venv/bin/python benchmarks/peer_gguf.py /tmp/llama7m /tmp/llama7m-f32.gguf
"""

import json
import os
import runpy
import sys

PEERS = os.environ.get("PEERS", os.path.expanduser("~/.cache/tidal-peers"))


def main(model: str, out: str) -> None:
    smollm = os.path.join(PEERS, "models", "smollm2-135m-instruct", "tokenizer.json")
    ours = json.load(open(os.path.join(model, "tokenizer.json")))["pre_tokenizer"]
    if ours != json.load(open(smollm))["pre_tokenizer"]:
        sys.exit(f"{model}: its pre-tokenizer is not SmolLM2's; this shortcut does not apply")
    llama_cpp = os.path.join(PEERS, "llama.cpp")
    sys.path.insert(0, llama_cpp)
    sys.path.insert(1, os.path.join(llama_cpp, "gguf-py"))
    from conversion.base import TextModel

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
    sys.argv = ["convert_hf_to_gguf.py", model, "--outtype", "f32", "--outfile", out]
    runpy.run_path(os.path.join(llama_cpp, "convert_hf_to_gguf.py"), run_name="__main__")


if __name__ == "__main__":
    main(*sys.argv[1:3])
