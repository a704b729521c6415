"""Write a "layer-skip" draft model: the first N decoder layers of a Llama-family folder, with
its embeddings, final norm, LM head and tokenizer (the same weights), as a folder that
`--speculative-config '{"method": "draft_model", "model": OUT, ...}'` takes.

    python benchmarks/layer_skip_draft.py MODEL_FOLDER OUT_FOLDER --layers 8

A self-speculative draft anyone can build when no smaller model shares the tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil

from safetensors.torch import load_file, save_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.model, "config.json")) as f:
        config = json.load(f)
    if not 1 <= args.layers <= config["num_hidden_layers"]:
        raise SystemExit(f"--layers must be in [1, {config['num_hidden_layers']}]")
    config["num_hidden_layers"] = args.layers
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    layer = re.compile(r"\.layers\.(\d+)\.")
    kept = {}
    for name in sorted(os.listdir(args.model)):
        path = os.path.join(args.model, name)
        if name.endswith(".safetensors"):
            for key, tensor in load_file(path).items():
                m = layer.search(key)
                if m is None or int(m.group(1)) < args.layers:
                    kept[key] = tensor
        elif name != "config.json" and not name.endswith(".index.json") and os.path.isfile(path):
            shutil.copy(path, args.out)  # tokenizer, chat template, generation config
    save_file(kept, os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    print(f"{args.out}: {args.layers} of the model's layers, {len(kept)} tensors")


if __name__ == "__main__":
    main()
