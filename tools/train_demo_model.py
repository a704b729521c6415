"""Train tidal's bundled demo model: a small Llama on the Python standard library's source.

The result is a normal Hugging Face folder (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json, README.md, corpus_files.txt) that ships inside
the package as ``tidal.frontend/demo_model`` so ``tidal serve`` works with no download.

Corpus: every ``.py`` file of this interpreter's standard library (``sysconfig`` "stdlib"),
in sorted relative-path order, excluding test folders, site-packages, generated tables
(encodings/, pydoc_data/) and files over ``--max-file-bytes``. The standard library is under the
PSF License, which allows shipping derived works. The exact file list, with sizes and SHA-256
digests, is written to ``corpus_files.txt`` next to the weights.

Reproducibility: one seed drives the tokenizer-independent parts (weight init, window order,
validation windows). With ``--max-minutes 0`` the run is a pure function of the seed, the corpus
and ``--max-steps``. With a time budget the learning-rate schedule follows
``max(step / max_steps, elapsed / budget)`` so a slow, shared machine still anneals before it
stops; the README records how many steps were actually run, so ``--max-steps N --max-minutes 0``
rebuilds the same schedule.

Run (about 25 minutes on 2 CPU threads)::

    python tools/train_demo_model.py --out frontend/demo_model
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

# Path components that take a folder out of the corpus: tests, third-party code,
# caches, and generated data tables that are not representative Python.
EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
     "encodings", "pydoc_data"}
)

EOS_TOKEN = "<|endoftext|>"
SYSTEM_TOKEN = "<|system|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
SPECIAL_TOKENS = [EOS_TOKEN, SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN]

# Each turn is "<|role|>\n{content}\n"; an assistant turn ends with <|endoftext|> so a reply
# stops at EOS. The generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ '<|endoftext|>' }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

SAMPLE_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\ndef read_lines(path):\n",
    "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n",
]


@dataclass
class TrainConfig:
    """Everything that determines the trained model; written into the README."""

    out: str
    """Output folder (a Hugging Face model folder)."""
    seed: int = 1234
    """Seed for weight init, window order and validation windows."""
    vocab_size: int = 4096
    """Byte-level BPE vocabulary size, special tokens included."""
    hidden_size: int = 256
    """Model width."""
    num_layers: int = 4
    """Number of decoder layers."""
    num_heads: int = 4
    """Number of query heads (head_dim = hidden_size / num_heads)."""
    num_kv_heads: int = 2
    """Number of key/value heads (grouped-query attention when < num_heads)."""
    intermediate_size: int = 688
    """SwiGLU MLP width."""
    max_position_embeddings: int = 1024
    """Longest context the config advertises (RoPE, no learned positions)."""
    seq_len: int = 256
    """Training window length in tokens."""
    batch_size: int = 16
    """Windows per optimizer step."""
    lr: float = 3e-3
    """Peak AdamW learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (cosine decay)."""
    warmup_steps: int = 50
    """Linear warm-up steps."""
    weight_decay: float = 0.1
    """AdamW weight decay (matrices only)."""
    max_steps: int = 1500
    """Optimizer steps for the schedule (training may stop earlier on the time budget)."""
    max_minutes: float = 25.0
    """Wall-clock budget for the training loop; 0 disables it (exact reproducibility)."""
    log_every: int = 25
    """Steps between train-loss log lines."""
    eval_every: int = 100
    """Steps between validation-loss evaluations (rows of the README loss table)."""
    num_threads: int = 2
    """torch CPU threads (the build machine is shared: keep this small)."""
    max_file_bytes: int = 250_000
    """Corpus files larger than this are skipped."""
    val_fraction: float = 0.02
    """Fraction of corpus files (every k-th in sorted order) held out for validation."""
    chat_fraction_files: int = 1
    """Emit chat-formatted docstring->function samples for every file (1) or none (0)."""


@dataclass
class CorpusFile:
    """One corpus file: path relative to the stdlib root, size, digest and text."""

    rel_path: str
    num_bytes: int
    sha256: str
    text: str = field(repr=False)


# ----------------------------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------------------------


def stdlib_root() -> Path:
    """The standard-library folder of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_excluded(rel_dir: Path) -> bool:
    parts = rel_dir.parts
    if any(part in EXCLUDED_DIRS for part in parts):
        return True
    # config-3.11-x86_64-linux-gnu holds build artefacts, not library code.
    return bool(parts) and parts[0].startswith("config-")


def collect_corpus(root: Path, max_file_bytes: int) -> list[CorpusFile]:
    """Sorted list of the stdlib's .py files that pass the exclusion rules and decode as UTF-8."""
    rel_paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        if _is_excluded(rel_dir):
            dirnames[:] = []
            continue
        rel_paths.extend(rel_dir / name for name in filenames if name.endswith(".py"))
    files = []
    for rel in sorted(rel_paths, key=lambda p: p.as_posix()):
        data = (root / rel).read_bytes()
        if len(data) > max_file_bytes:
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        files.append(CorpusFile(rel.as_posix(), len(data), hashlib.sha256(data).hexdigest(), text))
    return files


def split_files(files: list[CorpusFile], val_fraction: float):
    """Deterministic split: every k-th file (sorted order) goes to validation."""
    stride = max(2, round(1 / val_fraction))
    train = [f for i, f in enumerate(files) if i % stride != stride // 2]
    val = [f for i, f in enumerate(files) if i % stride == stride // 2]
    return train, val


def chat_samples(text: str) -> list[str]:
    """Chat-formatted samples: the user gives a function's docstring summary, the assistant
    answers with the function's source. Teaches the model what the chat markers mean."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    samples = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        source = ast.get_source_segment(text, node)
        if not doc or not source or len(source) > 2000:
            continue
        summary = doc.strip().splitlines()[0]
        samples.append(
            f"{USER_TOKEN}\nWrite a Python function `{node.name}`: {summary}\n"
            f"{ASSISTANT_TOKEN}\n{source}{EOS_TOKEN}\n"
        )
    return samples


def documents(files: list[CorpusFile], with_chat: bool) -> list[str]:
    """Training documents in fixed order: each file, then (optionally) its chat samples."""
    docs = []
    for f in files:
        docs.append(f.text)
        if with_chat:
            docs.extend(chat_samples(f.text))
    return docs


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def train_tokenizer(docs: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style pre-tokenization, no prefix space) with our special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def wrap_tokenizer(tok, max_len: int):
    """The fast tokenizer transformers loads with AutoTokenizer (no BOS added on encode)."""
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        additional_special_tokens=[SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN],
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def encode_stream(tok, docs: list[str]):
    """All documents as one int32 token stream, each document followed by <|endoftext|>."""
    import torch

    eos_id = tok.token_to_id(EOS_TOKEN)
    ids: list[int] = [eos_id]
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int32)


# ----------------------------------------------------------------------------------------------
# Model and training
# ----------------------------------------------------------------------------------------------


def build_model(cfg: TrainConfig, eos_id: int):
    """A Llama with tied embeddings and grouped-query attention, float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype="float32",
    )
    return LlamaForCausalLM(config)


def lr_at(cfg: TrainConfig, step: int, elapsed_s: float) -> float:
    """Linear warm-up, then cosine decay on progress = max(step, time) fraction."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = step / cfg.max_steps
    if cfg.max_minutes > 0:
        progress = max(progress, elapsed_s / (cfg.max_minutes * 60))
    progress = min(1.0, progress)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def make_optimizer(model, cfg: TrainConfig):
    """AdamW; weight decay on 2-D weights only (not norms)."""
    import torch

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def windows(stream, starts, seq_len: int):
    """Stack windows of seq_len+1 tokens starting at `starts`; returns (inputs, labels)."""
    import torch

    batch = torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()]).long()
    return batch[:, :-1], batch[:, 1:]



def epoch_starts(num_tokens: int, seq_len: int, seed: int, epoch: int):
    """Start offsets of the non-overlapping windows, shuffled by (seed, epoch)."""
    import torch

    num_windows = (num_tokens - 1) // seq_len
    gen = torch.Generator().manual_seed(seed * 1000 + epoch)
    return torch.randperm(num_windows, generator=gen) * seq_len


def batches(stream, cfg: TrainConfig):
    """Endless deterministic stream of (inputs, labels) batches, epoch after epoch."""
    epoch = 0
    while True:
        starts = epoch_starts(len(stream), cfg.seq_len, cfg.seed, epoch)
        for i in range(0, len(starts) - cfg.batch_size + 1, cfg.batch_size):
            yield epoch, windows(stream, starts[i : i + cfg.batch_size], cfg.seq_len)
        epoch += 1


def lm_loss(model, inputs, labels):
    """Mean next-token cross-entropy (labels are already shifted)."""
    import torch.nn.functional as F

    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def evaluate(model, val_stream, cfg: TrainConfig, max_windows: int = 32) -> float:
    """Mean loss over the first `max_windows` non-overlapping validation windows."""
    import torch

    num_windows = min(max_windows, (len(val_stream) - 1) // cfg.seq_len)
    starts = torch.arange(num_windows) * cfg.seq_len
    model.eval()
    losses = []
    with torch.no_grad():
        for i in range(0, num_windows, cfg.batch_size):
            inputs, labels = windows(val_stream, starts[i : i + cfg.batch_size], cfg.seq_len)
            losses.append(lm_loss(model, inputs, labels).item() * len(inputs))
    model.train()
    return sum(losses) / num_windows


@dataclass
class LogRow:
    """One row of the README loss table."""

    step: int
    tokens_seen: int
    epoch: int
    train_loss: float
    val_loss: float | None
    lr: float
    elapsed_s: float


def train(model, train_stream, val_stream, cfg: TrainConfig) -> list[LogRow]:
    """The training loop; stops at max_steps or when the time budget is spent."""
    import torch

    optimizer = make_optimizer(model, cfg)
    model.train()
    rows: list[LogRow] = [LogRow(0, 0, 0, float("nan"), evaluate(model, val_stream, cfg), 0.0, 0.0)]
    print(f"step 0 val_loss {rows[0].val_loss:.3f}", flush=True)
    start = time.monotonic()
    recent: list[float] = []
    step = 0
    for epoch, (inputs, labels) in batches(train_stream, cfg):
        elapsed = time.monotonic() - start
        if step >= cfg.max_steps or (cfg.max_minutes > 0 and elapsed > cfg.max_minutes * 60):
            break
        lr = lr_at(cfg, step, elapsed)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = lm_loss(model, inputs, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        recent.append(loss.item())
        if step % cfg.log_every == 0:
            print(f"step {step} epoch {epoch} loss {sum(recent[-cfg.log_every:]) / cfg.log_every:.3f} "
                  f"lr {lr:.2e} {time.monotonic() - start:.0f}s", flush=True)
        if step % cfg.eval_every == 0:
            rows.append(_row(model, val_stream, cfg, step, epoch, recent, lr, start))
            recent = []
    if rows[-1].step != step:
        rows.append(_row(model, val_stream, cfg, step, epoch, recent, lr, start))
    return rows


def _row(model, val_stream, cfg, step, epoch, recent, lr, start) -> LogRow:
    val = evaluate(model, val_stream, cfg)
    train_loss = sum(recent) / max(1, len(recent))
    row = LogRow(step, step * cfg.batch_size * cfg.seq_len, epoch, train_loss, val, lr,
                 time.monotonic() - start)
    print(f"step {step} train {train_loss:.3f} val {val:.3f} {row.elapsed_s:.0f}s", flush=True)
    return row


# ----------------------------------------------------------------------------------------------
# Output folder
# ----------------------------------------------------------------------------------------------


def greedy_samples(model, hf_tok, max_new_tokens: int = 64) -> list[tuple[str, str]]:
    """(prompt, greedy completion) for each sample prompt."""
    import torch

    model.eval()
    out = []
    for prompt in SAMPLE_PROMPTS:
        ids = hf_tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        out.append((prompt, hf_tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=False)))
    return out


def write_corpus_list(out: Path, files: list[CorpusFile], val: list[CorpusFile]) -> None:
    """corpus_files.txt: one line per file: split, bytes, sha256, path relative to stdlib."""
    val_names = {f.rel_path for f in val}
    lines = [f"# Python {platform.python_version()} standard library, root {stdlib_root()}",
             "# split\tbytes\tsha256\trel_path"]
    for f in files:
        split = "val" if f.rel_path in val_names else "train"
        lines.append(f"{split}\t{f.num_bytes}\t{f.sha256}\t{f.rel_path}")
    (out / "corpus_files.txt").write_text("\n".join(lines) + "\n")


def render_readme(cfg: TrainConfig, stats: dict, rows: list[LogRow], samples) -> str:
    """The model card: corpus, licence, architecture, loss table, sample completions."""
    table = ["| step | tokens seen | epoch | train loss | val loss | lr | elapsed (s) |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        train_loss = "-" if math.isnan(r.train_loss) else f"{r.train_loss:.3f}"
        table.append(f"| {r.step} | {r.tokens_seen:,} | {r.epoch} | {train_loss} | "
                     f"{r.val_loss:.3f} | {r.lr:.2e} | {r.elapsed_s:.0f} |")
    sample_md = []
    for prompt, completion in samples:
        sample_md += ["Prompt:", "", "```python", prompt.rstrip("\n"), "```", "",
                      "Greedy completion (64 new tokens):", "", "```python",
                      prompt + completion, "```", ""]
    cfg_json = json.dumps(cfg.__dict__, indent=2)
    return README_TEMPLATE.format(table="\n".join(table), samples="\n".join(sample_md),
                                  cfg_json=cfg_json, **stats)


README_TEMPLATE = """\
---
license: psf-2.0
library_name: transformers
pipeline_tag: text-generation
---

# tidal demo model (tidal-demo-llama-4m)

A {num_params_m:.2f}M-parameter Llama trained from scratch on the CPU, shipped inside the
`tidal` package so `tidal serve` answers without downloading anything. It writes
Python-looking code; it is a demo and test model, not a useful assistant.

## Corpus and licence

- Corpus: the `.py` sources of the Python {python_version} standard library
  (`sysconfig.get_paths()["stdlib"]`), sorted by relative path, excluding folders named
  test, tests, idle_test, site-packages, dist-packages, encodings, pydoc_data and
  config-*, and files over {max_file_bytes:,} bytes. {num_files} files, {corpus_mb:.1f} MB;
  every {val_stride}th file (sorted order) is held out for validation. The exact list with
  SHA-256 digests is in `corpus_files.txt`.
- For each function with a docstring, a chat sample is added:
  `<|user|>\\nWrite a Python function `name`: <docstring summary>\\n<|assistant|>\\n<source><|endoftext|>`.
- Licence: the Python standard library is distributed under the
  [PSF License Agreement](https://docs.python.org/3/license.html) (PSF-2.0), which permits
  distributing derived works. These weights are derived from it and are released under the
  same PSF-2.0 terms. Copyright (c) 2001-2023 Python Software Foundation; All Rights Reserved.

## Model

- `LlamaForCausalLM`: hidden {hidden_size}, {num_layers} layers, {num_heads} query heads /
  {num_kv_heads} key-value heads (grouped-query attention, head_dim {head_dim}),
  SwiGLU MLP {intermediate_size}, RoPE theta 10000, RMSNorm eps 1e-5,
  max_position_embeddings {max_position_embeddings}, tied input/output embeddings,
  float32 weights ({weights_mb:.1f} MB safetensors).
- Tokenizer: byte-level BPE (`tokenizers`), vocabulary {vocab_size} including the special
  tokens `<|endoftext|>` (id {eos_id}: BOS, EOS and pad), `<|system|>`, `<|user|>`,
  `<|assistant|>`. Encoding adds no BOS. Training streams are documents separated by
  `<|endoftext|>`.
- Chat template: each turn is `<|role|>\\n<content>\\n` (assistant turns end with
  `<|endoftext|>`), the generation prompt is `<|assistant|>\\n`.

## Training

Seed {seed}, AdamW (betas 0.9/0.95, weight decay {weight_decay}), peak lr {lr}, {warmup_steps}
warm-up steps then cosine decay to {min_lr_ratio} x peak, batch {batch_size} x {seq_len} tokens,
{num_threads} CPU threads, torch {torch_version}, transformers {transformers_version}.
Training tokens: {num_train_tokens:,}; validation tokens: {num_val_tokens:,}.
Ran {steps_run} steps in {train_minutes:.1f} minutes (stopped by: {stop_reason}).

Loss (nats per token; train is the mean over the steps since the previous row, val is the mean
over the first 32 validation windows):

{table}

## Samples (greedy, transformers `generate`)

Prompts that end in a bare newline split the "newline + indentation" token the
byte-level pre-tokenizer normally produces, so the model tends to start a new top-level
definition; a prompt such as `class Stack:\\n    def __init__(self):` (no trailing
newline) continues with an indented body. Quality is that of a 4M-parameter model trained
for under an hour on two shared CPU cores: code-shaped, repetitive, not meaningful.

{samples}
## Rebuild

```
python tools/train_demo_model.py --out frontend/demo_model --max-steps {steps_run} --max-minutes 0
```

{rebuild_note}
Full configuration:

```json
{cfg_json}
```
"""


def rebuild_note(cfg: TrainConfig, steps_run: int) -> str:
    """Whether the README's rebuild command reproduces these weights exactly."""
    if cfg.max_minutes <= 0:
        return ("reproduces these weights: the run was a pure function of the seed, the corpus "
                "(same Python version) and the step count.")
    return ("gives the same tokenizer, initial weights and data order, but not bit-identical "
            "weights: this run had a wall-clock budget, so its learning-rate schedule followed "
            f"elapsed time (progress = max(step / {cfg.max_steps}, elapsed / budget)); the "
            f"command uses a purely step-based cosine schedule over the same {steps_run} steps.")


def save_folder(out: Path, model, hf_tok, eos_id: int) -> None:
    """config.json, model.safetensors, tokenizer files, generation_config.json."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    model.save_pretrained(out, safe_serialization=True)
    hf_tok.save_pretrained(out)
    portable_tokenizer_config(out, hf_tok)
    for path in out.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; package data must be world-readable


def portable_tokenizer_config(out: Path, hf_tok) -> None:
    """Rewrite tokenizer_config.json in the form transformers 4.x and 5.x both load:
    class PreTrainedTokenizerFast, chat template inline (no chat_template.jinja), and the
    chat markers as additional_special_tokens."""
    (out / "chat_template.jinja").unlink(missing_ok=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": hf_tok.model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------


def parse_args(argv=None) -> TrainConfig:
    """Command-line flags: one per TrainConfig field."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = TrainConfig(out="")
    for name, value in defaults.__dict__.items():
        flag = "--" + name.replace("_", "-")
        if name == "out":
            parser.add_argument(flag, required=True, help="output model folder")
        else:
            parser.add_argument(flag, type=type(value), default=value)
    return TrainConfig(**vars(parser.parse_args(argv)))


def main(argv=None) -> None:
    """Build the corpus, train tokenizer and model, write the model folder."""
    cfg = parse_args(argv)
    os.environ.setdefault("RAYON_NUM_THREADS", str(cfg.num_threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    import torch
    import transformers

    torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    t0 = time.monotonic()

    files = collect_corpus(stdlib_root(), cfg.max_file_bytes)
    train_files, val_files = split_files(files, cfg.val_fraction)
    train_docs = documents(train_files, with_chat=bool(cfg.chat_fraction_files))
    val_docs = documents(val_files, with_chat=False)
    tok = train_tokenizer(train_docs, cfg.vocab_size)
    eos_id = tok.token_to_id(EOS_TOKEN)
    train_stream = encode_stream(tok, train_docs)
    val_stream = encode_stream(tok, val_docs)
    print(f"corpus {len(files)} files, train {len(train_stream):,} tokens, "
          f"val {len(val_stream):,} tokens, prep {time.monotonic() - t0:.0f}s", flush=True)

    model = build_model(cfg, eos_id)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model {num_params:,} params", flush=True)
    rows = train(model, train_stream, val_stream, cfg)

    hf_tok = wrap_tokenizer(tok, cfg.max_position_embeddings)
    save_folder(out, model, hf_tok, eos_id)
    write_corpus_list(out, files, val_files)
    samples = greedy_samples(model, hf_tok)
    steps_run = rows[-1].step
    stats = dict(
        cfg.__dict__, num_params_m=num_params / 1e6, python_version=platform.python_version(),
        num_files=len(files), corpus_mb=sum(f.num_bytes for f in files) / 1e6,
        val_stride=max(2, round(1 / cfg.val_fraction)), head_dim=cfg.hidden_size // cfg.num_heads,
        weights_mb=(out / "model.safetensors").stat().st_size / 1e6, eos_id=eos_id,
        torch_version=torch.__version__, transformers_version=transformers.__version__,
        num_train_tokens=len(train_stream), num_val_tokens=len(val_stream), steps_run=steps_run,
        train_minutes=rows[-1].elapsed_s / 60,
        stop_reason="max_steps" if steps_run >= cfg.max_steps else "time budget",
    )
    stats["rebuild_note"] = rebuild_note(cfg, steps_run)
    (out / "README.md").write_text(render_readme(cfg, stats, rows, samples))
    for prompt, completion in samples:
        print("=" * 40, "\n" + prompt + completion, flush=True)
    print(f"wrote {out} in {(time.monotonic() - t0) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    sys.exit(main())
