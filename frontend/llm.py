"""`LLM`: the blocking Python frontend for offline batches.

    llm = LLM("path/to/model", max_num_seqs=64)     # starts a private engine-core daemon
    llm = LLM(engine="ipc:///run/user/1000/tidal/engine.sock")   # attaches to a running one
    outputs = llm.generate(["Hello", "The capital of"], SamplingParams(max_tokens=32))
    outputs = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=32))

Engine flags are keyword arguments with the command-line names (`max_num_batched_tokens=32`,
`enable_prefix_caching=False`, `num_gpu_blocks_override=64`, `tensor_parallel_size=2`,
`pipeline_parallel_size=2`...).

`LLM` runs an `AsyncLLM` on a private uvloop event loop in a background thread: one code path
for detokenization, stop strings, n > 1, heartbeats and engine-death handling. `generate`
(and `chat`, which renders conversations through the chat template first) submits the whole
batch, shows a tqdm bar with the live output tokens/s (on a terminal; into a log, one line
at the end instead), and returns the finished outputs in input order.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import sys
import threading
import time
import weakref
from collections.abc import Sequence

from ..engine_core.args import add_engine_args, config_from_args
from ..engine_core.config import EngineConfig
from .async_llm import (
    DEFAULT_ENGINE_RESTART_TIMEOUT_S,
    DEFAULT_MAX_ENGINE_RESTARTS,
    AsyncLLM,
)
from .chat_template import (
    RESERVED_TEMPLATE_KWARGS,
    normalize_conversation,
    render_chat,
)
from .outputs import EmbeddingRequestOutput, RequestOutput
from .tools import parse_tools, template_messages
from .tools.options import load_chat_template
from ..ipc.frontend_messages import SchedulerStats
from ..ipc.messages import LoRARequest, SamplingParams, check_priority
from ..ipc.pooling import PoolingParams

logger = logging.getLogger(__name__)

# keyword names accepted besides the flags' own (EngineConfig field names)
_FLAG_ALIASES = {"num_kv_blocks_override": "num_gpu_blocks_override"}


def engine_config_from_kwargs(model: str, **engine_flags) -> EngineConfig:
    """An EngineConfig from a model folder and flag-named keyword arguments.

    ValueError naming an unknown keyword; values given as strings go through the flag's own
    parser (so `kv_cache_memory="64MiB"` and `dtype="half"` work as on the command line).
    """
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser, docs=False)
    ns = parser.parse_args([])
    ns.model = model
    actions = {a.dest: a for a in parser._actions}
    for key, value in engine_flags.items():
        dest = _FLAG_ALIASES.get(key, key)
        if dest not in actions or dest in ("model_tag", "model"):
            known = sorted(d for d in actions if d not in ("model_tag", "model", "help"))
            raise ValueError(f"{key} is not an engine flag; known: {', '.join(known)}")
        action = actions[dest]
        if isinstance(value, str) and action.type is not None:
            try:
                value = action.type(value)
            except (argparse.ArgumentTypeError, ValueError) as e:
                raise ValueError(f"{key}: {e}") from None
        setattr(ns, dest, value)
    return config_from_args(ns)


def default_model() -> str:
    """The bundled demo model's folder; ValueError when this install has none."""
    try:
        from .demo import demo_model_path
    except ImportError:
        raise ValueError("model is required: this install has no bundled demo model "
                         "(pass a local Hugging Face model folder)") from None
    try:
        return demo_model_path()
    except FileNotFoundError as e:
        raise ValueError(f"model is required: {e}") from None


class LLM:
    """A blocking frontend (see the module docstring). Use as a context manager or close()."""

    def __init__(self, model: str | None = None, *, engine: str | None = None,
                 key_file: str | None = None, tokenizer: str | None = None,
                 startup_timeout: float = 300.0,
                 engine_restart_timeout: float = DEFAULT_ENGINE_RESTART_TIMEOUT_S,
                 max_engine_restarts: int = DEFAULT_MAX_ENGINE_RESTARTS,
                 frontend_timeout: float | None = None, **engine_flags):
        """Start a private daemon for `model` (None: the bundled demo model) with
        `engine_flags`, or attach to the daemon at `engine` (then no model or flags).

        If the engine core dies (or goes away), unfinished requests wait up to
        `engine_restart_timeout` seconds for it to come back and are then resubmitted, so
        `generate` returns what a fault-free run would; a private daemon is started again up
        to `max_engine_restarts` times (AsyncLLM's module docstring); one that stays silent
        for `frontend_timeout` seconds (None: the daemon's default, `tidal serve
        --frontend-timeout`) is taken as stopped or hung, killed and started again."""
        if engine is not None and (model is not None or engine_flags):
            raise ValueError("engine: attaching to a running engine core takes no model or "
                             "engine flags (the daemon was started with its own)")
        config = None
        if engine is None:
            config = engine_config_from_kwargs(model or default_model(), **engine_flags)
        self._loop = _new_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tidal-llm-loop",
                                        daemon=True)
        self._thread.start()
        self._ids = itertools.count()
        try:
            self._llm: AsyncLLM = self._call(AsyncLLM.create(
                config, engine=engine, key_file=key_file, tokenizer=tokenizer,
                startup_timeout=startup_timeout, engine_restart_timeout=engine_restart_timeout,
                max_engine_restarts=max_engine_restarts, frontend_timeout=frontend_timeout))
        except BaseException:
            _stop_loop(self._loop, self._thread)
            raise
        # close() when collected or at interpreter exit (before the daemon's own finalizer,
        # since finalizers run newest first), so a forgotten LLM still detaches cleanly
        self._finalizer = weakref.finalize(self, _shutdown, self._loop, self._thread, self._llm)

    @property
    def engine_info(self):
        """What the daemon said about itself (max_model_len, num_kv_blocks, ...)."""
        return self._llm.engine_info

    @property
    def tokenizer(self):
        """The model's fast Hugging Face tokenizer."""
        return self._llm.tokenizer

    @property
    def daemon_pid(self) -> int | None:
        """The private daemon's pid, or None when attached to someone else's."""
        return self._llm.daemon_pid

    def get_tokenizer(self):
        """The model's fast Hugging Face tokenizer (vLLM's name)."""
        return self._llm.tokenizer

    def generate(self, prompts: str | list[int] | dict | Sequence[str | list[int] | dict],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, *,
                 priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or a vLLM-style dict with "prompt" or
        "prompt_token_ids"); outputs in input order.

        `sampling_params`: one for all prompts, or one per prompt (None: the defaults).
        `priority`: one per prompt (with --scheduling-policy priority; lower runs first;
        under fcfs any value but 0 is a ValueError, as in vLLM).
        `lora_request`: a `LoRARequest(lora_name, lora_int_id, lora_path)` for all prompts, or
        one (or None: the base model) per prompt, with `enable_lora=True` (docs/lora.md).
        Every prompt is checked (ValueError) before any is sent; a request the engine core
        refuses all the same raises ValueError naming the field, and the rest of the batch
        is aborted. If the engine core dies and no core comes back (see `__init__`), the
        unfinished outputs end with finish_reason "error".
        """
        prompt_list = _normalize_prompts(prompts)
        params = self._check_batch(len(prompt_list), sampling_params, priority)
        loras = self._check_loras(len(prompt_list), lora_request)
        prompt_ids = [self._llm.encode_prompt(p) for p in prompt_list]
        texts = [p if isinstance(p, str) else None for p in prompt_list]
        return self._generate(texts, prompt_ids, params, use_tqdm, priority, loras)

    def _check_loras(self, num_prompts: int, lora_request) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt, each folder checked (ValueError)."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * num_prompts
        else:
            loras = list(lora_request)
            if len(loras) != num_prompts:
                raise ValueError(f"lora_request has {len(loras)} entries for {num_prompts} "
                                 "prompts")
        for lora in {id(x): x for x in loras if x is not None}.values():
            self._llm.check_lora(lora)
        return loras

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or
        to a list of conversations, through the tokenizer's chat template or `chat_template`
        (a Jinja string, or the path of a file holding one, as `--chat-template`); outputs in
        input order, as `generate` returns them, with the rendered text as `prompt`.

        `tools` (OpenAI's `[{"type": "function", "function": {...}}]`) are handed to the
        template as `tools=`, and an assistant message's `tool_calls` reach it with their
        arguments as objects, as the server does (docs/tools.md); the reply is not parsed
        for calls.

        `add_generation_prompt` ends the prompt with the assistant's turn header;
        `continue_final_message` leaves the last message open for the model to continue
        (then `add_generation_prompt` must be False, as in vLLM and transformers);
        `chat_template_kwargs` are extra template variables. ValueError when there is no
        template, a message is malformed, or the template fails on a conversation.
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be "
                             "True: continue the last message, or start the assistant's turn")
        reserved = RESERVED_TEMPLATE_KWARGS.intersection(chat_template_kwargs or {})
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {sorted(reserved)}: they are "
                             "chat()'s own parameters")
        batched = (isinstance(messages, (list, tuple)) and bool(messages)
                   and all(isinstance(c, (list, tuple)) for c in messages))
        conversations = list(messages) if batched else [messages]
        params = self._check_batch(len(conversations), sampling_params, None)
        chat_template = load_chat_template(chat_template)
        if tools:
            parse_tools(tools)  # ValueError naming tools[i]
            chat_template_kwargs = {**(chat_template_kwargs or {}), "tools": tools}
        texts, prompt_ids = [], []
        for i, conversation in enumerate(conversations):
            where = f"messages[{i}]" if batched else "messages"
            conversation = template_messages(normalize_conversation(conversation, where))
            text, ids = render_chat(self.tokenizer, conversation,
                                    chat_template=chat_template,
                                    add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message,
                                    chat_template_kwargs=chat_template_kwargs)
            texts.append(text)
            prompt_ids.append(self._llm.encode_prompt(ids))
        return self._generate(texts, prompt_ids, params, use_tqdm, None)

    def _check_batch(self, num_prompts: int, sampling_params,
                     priority: Sequence[int] | None) -> list[SamplingParams]:
        """One SamplingParams per prompt; ValueError for a priority list of the wrong
        length, or a priority the engine's policy refuses."""
        params = _normalize_params(sampling_params, num_prompts)
        if priority is not None and len(priority) != num_prompts:
            raise ValueError(f"priority has {len(priority)} entries for {num_prompts} prompts")
        for value in priority or ():
            check_priority(value, self.engine_info.scheduling_policy)
        return params

    def _generate(self, texts: list[str | None], prompt_ids: list[list[int]],
                  params: list[SamplingParams], use_tqdm: bool,
                  priority: Sequence[int] | None,
                  loras: list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run checked prompts (their text, if any, and token ids) to the end."""
        batch = [(str(next(self._ids)), text, ids, sp, priority[i] if priority else 0,
                  loras[i] if loras else None)
                 for i, (text, ids, sp) in enumerate(zip(texts, prompt_ids, params))]
        progress = _Progress(len(batch), use_tqdm)
        fut = asyncio.run_coroutine_threadsafe(self._run_batch(batch, progress), self._loop)
        try:
            while True:
                try:
                    return fut.result(timeout=0.2)
                except TimeoutError:
                    progress.refresh(self._llm.num_generated_tokens)
        except BaseException:
            fut.cancel()  # aborts every request of the batch in the engine
            _settle(self._loop)
            raise
        finally:
            progress.close(self._llm.num_generated_tokens)

    async def _run_batch(self, batch, progress: "_Progress") -> list[RequestOutput]:
        tasks = []
        for request_id, text, ids, sp, prio, lora in batch:
            task = asyncio.ensure_future(self._llm.generate_final(
                ids if text is None else text, sp, request_id, priority=prio,
                prompt_token_ids=ids, lora_request=lora))
            task.add_done_callback(progress.one_done)
            tasks.append(task)
        progress.start(self._llm.num_generated_tokens)
        try:
            outputs = await asyncio.gather(*tasks)
        except BaseException:  # a refused request (ValueError): the rest of the batch stops
            for task in tasks:
                task.cancel()  # aborts each one still running in the engine
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        if self._llm.dead:
            logger.error("the engine core died during generate(): %s", self._llm.dead_reason)
        return list(outputs)

    def embed(self, prompts: str | list[int] | dict | Sequence[str | list[int] | dict],
              pooling_params: PoolingParams | None = None, use_tqdm: bool = True
              ) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (text, token ids, or a dict with "prompt" or
        "prompt_token_ids"), in input order, as vLLM's `LLM.embed`: `out.outputs.embedding`.
        Needs an engine started with runner="pooling" (docs/embeddings.md); every prompt is
        batched through the scheduler as a prefill. ValueError naming the field for a bad
        prompt, `dimensions` the model does not allow, or an engine that only generates."""
        prompt_list = _normalize_prompts(prompts)
        if self.engine_info.pooler is None:
            raise ValueError("pooling: this engine generates text; LLM.embed needs "
                             "LLM(model, runner=\"pooling\")")
        self.engine_info.pooler.resolve(pooling_params)  # ValueError before anything is sent
        prompt_ids = [self._llm.encode_embedding_prompt(p) for p in prompt_list]
        batch = [(str(next(self._ids)), p if isinstance(p, str) else None, ids)
                 for p, ids in zip(prompt_list, prompt_ids)]
        progress = _Progress(len(batch), use_tqdm)

        async def run_all() -> list[EmbeddingRequestOutput]:
            tasks = [asyncio.ensure_future(self._llm.embed(
                ids if text is None else text, pooling_params, request_id,
                prompt_token_ids=ids)) for request_id, text, ids in batch]
            for task in tasks:
                task.add_done_callback(progress.one_done)
            progress.start(0)
            try:
                return list(await asyncio.gather(*tasks))
            except BaseException:  # a refused request: the rest of the batch stops
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

        fut = asyncio.run_coroutine_threadsafe(run_all(), self._loop)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()
            _settle(self._loop)
            raise
        finally:
            progress.close(0)

    def get_stats(self) -> SchedulerStats:
        """A fresh snapshot of the engine core's statistics."""
        return self._call(self._llm.get_stats())

    def close(self) -> None:
        """Detach from the daemon, stopping it if this LLM started it. Idempotent."""
        self._finalizer()

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shutdown(loop: asyncio.AbstractEventLoop, thread: threading.Thread, llm: AsyncLLM) -> None:
    if loop.is_closed() or not thread.is_alive():
        return
    try:
        asyncio.run_coroutine_threadsafe(llm.close(), loop).result(timeout=60)
    finally:
        _stop_loop(loop, thread)


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10.0)
    if not thread.is_alive():
        loop.close()


def _settle(loop: asyncio.AbstractEventLoop) -> None:
    """Let the loop run the cancellation just requested (the aborts go out before we return)."""
    async def a_few_turns():
        for _ in range(3):
            await asyncio.sleep(0)

    try:
        asyncio.run_coroutine_threadsafe(a_few_turns(), loop).result(timeout=2.0)
    except Exception:  # noqa: BLE001 - best effort while an interrupt propagates
        pass


def _new_loop() -> asyncio.AbstractEventLoop:
    import uvloop

    return uvloop.new_event_loop()


def _normalize_prompts(prompts) -> list[str | list[int]]:
    """A prompt or a list of prompts: text, token ids, or vLLM's dicts {"prompt": text} /
    {"prompt_token_ids": ids}."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    elif isinstance(prompts, (list, tuple)) and prompts and all(
            isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt given as token ids
    prompt_list = []
    for i, p in enumerate(prompts):
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                p = list(p["prompt_token_ids"])
            elif "prompt" in p:
                p = p["prompt"]
            else:
                raise ValueError(f"prompts[{i}] must have 'prompt' or 'prompt_token_ids'")
        if not isinstance(p, (str, list, tuple)):
            raise ValueError(f"prompts[{i}] must be a string or a list of token ids, "
                             f"got {type(p).__name__}")
        prompt_list.append(p if isinstance(p, str) else list(p))
    return prompt_list


def _normalize_params(params, num_prompts: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    params = list(params)
    if len(params) != num_prompts:
        raise ValueError(f"sampling_params has {len(params)} entries for {num_prompts} prompts")
    for i, sp in enumerate(params):
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling_params[{i}] must be a SamplingParams")
    return params


class _Progress:
    """A tqdm bar over requests with the live output tokens/s (no-op when disabled).

    Only on a terminal (or in a notebook): into a file or pipe each refresh would be a line
    of the log, so there the bar is left out and `close` writes one summary line."""

    def __init__(self, total: int, enabled: bool, stream=None):
        self._bar = None
        self._stream = stream if stream is not None else sys.stderr
        self._total, self._done = total, 0
        self._summary = enabled and total > 0 and not _shows_a_bar(self._stream)
        if enabled and total and not self._summary:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc="Processed prompts", unit="req",
                             dynamic_ncols=True, file=self._stream)
        self._start_tokens = 0
        self._start_time = time.monotonic()

    def start(self, num_tokens: int) -> None:
        self._start_tokens, self._start_time = num_tokens, time.monotonic()

    def one_done(self, _task) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.update(1)

    def _rate(self, num_tokens: int) -> float:
        elapsed = max(time.monotonic() - self._start_time, 1e-6)
        return (num_tokens - self._start_tokens) / elapsed

    def refresh(self, num_tokens: int) -> None:
        if self._bar is None:
            return
        self._bar.set_postfix_str(f"output: {self._rate(num_tokens):.1f} tok/s", refresh=True)

    def close(self, num_tokens: int) -> None:
        if self._bar is not None:
            self.refresh(num_tokens)
            self._bar.close()
        elif self._summary:
            rate = (f", output: {self._rate(num_tokens):.1f} tok/s"
                    if num_tokens > self._start_tokens else "")  # none for embeddings
            self._stream.write(f"Processed prompts: {self._done}/{self._total} in "
                               f"{time.monotonic() - self._start_time:.1f} s{rate}\n")
            self._stream.flush()


def _shows_a_bar(stream) -> bool:
    """Whether a progress bar on `stream` is seen as one line redrawn: a terminal, or a
    notebook (whose stderr is no tty, and where tqdm.auto draws a widget)."""
    try:
        if stream.isatty():
            return True
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
    return "ipykernel" in sys.modules
