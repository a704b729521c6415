"""`AsyncLLM`: the asyncio frontend (streaming, abort, stats), on uvloop.

    llm = await AsyncLLM.create(config)            # starts a private engine-core daemon
    llm = await AsyncLLM.create(engine=ADDRESS)    # attaches to a running one
    async for out in llm.generate("Hello", SamplingParams(max_tokens=32)):
        print(out.outputs[0].delta_text, end="")
    await llm.close()

One background task reads the socket and routes outputs, through the `OutputProcessor`
(detokenize, stop strings, n > 1, stream interval), into one `RequestOutputCollector` per
request. A collector holds at most one pending update: if the consumer falls behind, newer
deltas are merged into it (vLLM's back-pressure without unbounded queues). A request the engine
core refuses (bad input) makes `generate` raise ValueError naming the field. Engine death (an
`EngineDead` message, a lost connection, or the private daemon process gone) ends every
pending request with finish_reason "error"; later calls raise RuntimeError.

Run it on uvloop: `tidal.frontend.async_llm.run(main())` (or `uvloop.run`); uvicorn picks
uvloop by itself.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator

from tidal.engine_core.config import EngineConfig
from tidal.frontend.engine_client import (
    AsyncEngineClient,
    encode_prompt,
    load_tokenizer,
    read_eos_token_ids,
)
from tidal.frontend.launcher import DaemonProcess
from tidal.frontend.output_processor import OutputProcessor
from tidal.frontend.outputs import CompletionOutput, RequestOutput
from tidal.ipc.messages import (
    Abort,
    EngineDead,
    EngineInfo,
    EngineOutputs,
    SamplingParams,
    SchedulerStats,
    StatsQuery,
    check_priority,
    is_valid_unicode,
)

logger = logging.getLogger(__name__)

_OUTPUT_CHUNK = 128  # outputs processed between two yields to the event loop (vLLM's default)
_STATS_TIMEOUT_S = 10.0
_DAEMON_POLL_S = 0.5


def run(main):
    """Run coroutine `main` on a fresh uvloop event loop (like `asyncio.run`)."""
    import uvloop

    return uvloop.run(main)


async def _in_own_thread(fn):
    """Run blocking `fn` in a new thread and await it. Unlike asyncio.to_thread this also
    works at interpreter exit, after the default executor has been shut down."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def target():
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(_settle_future, fut, None, e)
        else:
            loop.call_soon_threadsafe(_settle_future, fut, result, None)

    threading.Thread(target=target, name="tidal-blocking", daemon=True).start()
    return await fut


def _settle_future(fut: asyncio.Future, result, error) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class RequestOutputCollector:
    """The hand-off point between the output task and one `generate()` consumer."""

    def __init__(self) -> None:
        self._pending: RequestOutput | None = None
        self._error: Exception | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        """Deliver an update; merged into the pending one if the consumer has not taken it."""
        self._pending = output if self._pending is None else merge_outputs(self._pending, output)
        self._ready.set()

    def fail(self, error: Exception) -> None:
        """End the request with `error`, raised by the next `get()`."""
        self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The next (possibly merged) update; raises the error given to `fail()`."""
        while self._pending is None and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        if self._error is not None:
            raise self._error
        output, self._pending = self._pending, None
        return output


def merge_outputs(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """One update equal to `old` followed by `new` (cumulative fields from new, deltas joined)."""
    by_index = {c.index: c for c in old.outputs}
    for comp in new.outputs:
        prev = by_index.get(comp.index)
        by_index[comp.index] = comp if prev is None else _merge_completion(prev, comp)
    outputs = [by_index[i] for i in sorted(by_index)]
    return RequestOutput(new.request_id, new.prompt, new.prompt_token_ids, outputs,
                         new.finished, new.metrics, new.prompt_logprobs or old.prompt_logprobs)


def _merge_completion(prev: CompletionOutput, comp: CompletionOutput) -> CompletionOutput:
    delta_logprobs = comp.delta_logprobs
    if prev.delta_logprobs is not None and comp.delta_logprobs is not None:
        delta_logprobs = prev.delta_logprobs + comp.delta_logprobs
    return CompletionOutput(
        index=comp.index, text=comp.text, token_ids=comp.token_ids,
        delta_text=prev.delta_text + comp.delta_text,
        delta_token_ids=prev.delta_token_ids + comp.delta_token_ids,
        logprobs=comp.logprobs, delta_logprobs=delta_logprobs,
        cumulative_logprob=comp.cumulative_logprob, finish_reason=comp.finish_reason,
        stop_reason=comp.stop_reason, error=comp.error)


class AsyncLLM:
    """An asyncio frontend attached to one engine-core daemon (see the module docstring)."""

    engine_info: EngineInfo
    """What the daemon said about itself at attach time (max_model_len, stream_interval...)."""
    tokenizer: object
    """The model's fast Hugging Face tokenizer."""
    model_name: str
    """The served model name."""

    def __init__(self, client: AsyncEngineClient, info: EngineInfo, tokenizer,
                 eos_token_ids: list[int], daemon: DaemonProcess | None):
        """Use `AsyncLLM.create`; this wires already-started parts together."""
        self._client = client
        self.client_id = client.client_id
        self.engine_info = info
        self.tokenizer = tokenizer
        self.model_name = info.served_model_name or info.model
        self._daemon = daemon
        self._processor = OutputProcessor(tokenizer, eos_token_ids[0] if eos_token_ids else None,
                                          eos_token_ids[1:])
        self._collectors: dict[str, RequestOutputCollector] = {}  # request_id -> collector
        self._stats_waiters: list[asyncio.Future] = []
        self.latest_stats: SchedulerStats | None = None
        self.num_generated_tokens = 0  # tokens received from the engine, all requests
        self.dead = False
        self.dead_reason: str | None = None
        self._closed = False
        self._tasks = [asyncio.ensure_future(self._output_loop())]
        if daemon is not None:
            self._tasks.append(asyncio.ensure_future(self._watch_daemon()))

    # -- construction ---------------------------------------------------------------------

    @classmethod
    async def create(cls, config: EngineConfig | None = None, *, engine: str | None = None,
                     key_file: str | None = None, client_kind: str = "python",
                     tokenizer: str | None = None, startup_timeout: float = 300.0,
                     echo_daemon_output: bool = True) -> "AsyncLLM":
        """Start a private daemon for `config`, or attach to the daemon at `engine`.

        Exactly one of `config` and `engine`. `tokenizer` overrides the tokenizer folder
        (default: the config's, or the one the daemon names). RuntimeError, quoting the
        daemon's last output, if it does not become ready within `startup_timeout` seconds.
        """
        if (config is None) == (engine is None):
            raise ValueError("give exactly one of config (start a daemon) or engine (attach)")
        daemon = None
        if config is not None:
            daemon = DaemonProcess(config, echo=echo_daemon_output)
            engine = daemon.address
            tokenizer = tokenizer or config.model.tokenizer_path
        try:
            return await cls._attach(engine, key_file, client_kind, tokenizer, daemon,
                                     startup_timeout)
        except BaseException:
            if daemon is not None:
                await _in_own_thread(daemon.stop)
            raise

    @classmethod
    async def _attach(cls, address: str, key_file: str | None, kind: str,
                      tokenizer_path: str | None, daemon: DaemonProcess | None,
                      timeout: float) -> "AsyncLLM":
        client = AsyncEngineClient(address, key_file, kind)
        client.start()
        # load the tokenizer while the daemon starts (its path is known up front when we own it)
        tok_task = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, tokenizer_path)) \
            if tokenizer_path else None
        try:
            info = await client.wait_for_info(timeout, daemon.alive if daemon else None)
        except RuntimeError as e:
            await client.close()
            if tok_task is not None:
                tok_task.cancel()
            if daemon is None:
                raise
            await _in_own_thread(lambda: daemon.wait(2.0))  # it is exiting: take its last words
            raise RuntimeError(daemon.failure_message(str(e))) from None
        if tok_task is None:
            tok_task = asyncio.to_thread(load_tokenizer, info.tokenizer or info.model)
        try:
            tok = await tok_task
        except BaseException:
            await client.close()
            raise
        eos_ids = read_eos_token_ids(info.model, tok)  # generation_config.json of the model
        return cls(client, info, tok, eos_ids, daemon)

    # -- requests -------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of `prompt`; ValueError if empty or too long (both numbers given)."""
        return encode_prompt(self.tokenizer, prompt, self.engine_info.max_model_len,
                             self.engine_info.vocab_size)

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None, *, priority: int = 0,
                       stream_interval: int | None = None) -> AsyncIterator[RequestOutput]:
        """Stream updates of one request: the first token at once, then every
        `stream_interval` tokens (the engine's when None; a request may only raise it), the
        rest when it finishes. Leaving the loop early (break, cancellation, an HTTP client
        gone) aborts the request in the engine. ValueError naming the field when the prompt
        or the engine core refuses the request."""
        interval = max(self.engine_info.stream_interval, stream_interval or 1)
        request_id, collector = self._add_request(prompt, params, request_id, priority,
                                                  interval, final_only=False)
        finished = False
        try:
            while not finished:
                output = await collector.get()
                finished = output.finished
                yield output
        finally:
            self._collectors.pop(request_id, None)
            if not finished:
                self._abort_quietly(request_id)

    async def generate_final(self, prompt: str | list[int], params: SamplingParams,
                             request_id: str | None = None, *, priority: int = 0,
                             prompt_token_ids: list[int] | None = None) -> RequestOutput:
        """The finished result of one request (all n completions), without streaming.

        `prompt_token_ids`: the prompt already encoded by `encode_prompt` (not re-checked).
        ValueError naming the field when the engine core refuses the request.
        """
        request_id, collector = self._add_request(prompt, params, request_id, priority, 1,
                                                  final_only=True, prompt_ids=prompt_token_ids)
        try:
            output = await collector.get()
        finally:
            self._collectors.pop(request_id, None)
            if self._processor.has_request(request_id):
                self._abort_quietly(request_id)
        return output

    def _add_request(self, prompt, params: SamplingParams, request_id: str | None,
                     priority: int, interval: int, final_only: bool,
                     prompt_ids: list[int] | None = None):
        self._check_usable()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        check_priority(priority, self.engine_info.scheduling_policy)
        request_id = request_id or uuid.uuid4().hex
        if not is_valid_unicode(request_id):
            raise ValueError("request_id must be valid Unicode (no lone surrogates)")
        if prompt_ids is None:
            prompt_ids = self.encode_prompt(prompt)
        messages = self._processor.add_request(
            request_id, f"{self.client_id}-{request_id}",
            prompt if isinstance(prompt, str) else None, prompt_ids, params,
            self.engine_info.max_model_len, priority=priority, final_only=final_only,
            stream_interval=interval)
        collector = RequestOutputCollector()
        self._collectors[request_id] = collector
        for msg in messages:
            self._client.send_nowait(msg)
        return request_id, collector

    async def abort(self, request_id: str) -> None:
        """Abort a request; its generator ends with finish_reason "abort". Unknown ids: no-op."""
        output, engine_ids = self._processor.finish_request(request_id, "abort")
        if engine_ids:
            self._client.send_nowait(Abort(engine_ids))
        if output is not None and request_id in self._collectors:
            self._collectors[request_id].put(output)

    def _abort_quietly(self, request_id: str) -> None:
        engine_ids = self._processor.abort_request(request_id)
        if engine_ids and not self.dead:
            self._client.send_nowait(Abort(engine_ids))

    def num_unfinished_requests(self) -> int:
        """This frontend's requests still in flight."""
        return self._processor.num_unfinished_requests()

    async def get_stats(self) -> SchedulerStats:
        """A fresh snapshot of the engine core's statistics (the whole server)."""
        self._check_usable()
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(fut)
        self._client.send_nowait(StatsQuery(self.client_id))
        try:
            return await asyncio.wait_for(fut, _STATS_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RuntimeError(f"engine core sent no statistics within {_STATS_TIMEOUT_S} s") \
                from None
        finally:
            if fut in self._stats_waiters:
                self._stats_waiters.remove(fut)

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this AsyncLLM is closed")
        if self.dead:
            raise RuntimeError(f"the engine core is dead: {self.dead_reason}")

    # -- background tasks -----------------------------------------------------------------

    async def _output_loop(self) -> None:
        try:
            while True:
                msg = await self._client.recv()
                if isinstance(msg, EngineOutputs):
                    await self._handle_outputs(msg)
                elif isinstance(msg, EngineDead):
                    self._on_dead(msg.reason)
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - never leave requests hanging
            logger.exception("output handler failed")
            self._on_dead(f"the frontend's output handler failed: {e!r}")

    async def _handle_outputs(self, msg: EngineOutputs) -> None:
        outputs = msg.outputs
        for start in range(0, len(outputs), _OUTPUT_CHUNK):
            if start:
                await asyncio.sleep(0)  # let consumers run between big chunks
            chunk = outputs[start:start + _OUTPUT_CHUNK]
            self.num_generated_tokens += sum(len(o.new_token_ids) for o in chunk) // 4
            processed = self._processor.process_outputs(chunk)
            if processed.reqs_to_abort:
                self._client.send_nowait(Abort(processed.reqs_to_abort))
            self._deliver(processed.request_outputs)
            self._deliver_refusals(processed.refused)
        if msg.stats is not None:
            self.latest_stats = msg.stats
            for fut in self._stats_waiters:
                if not fut.done():
                    fut.set_result(msg.stats)
            self._stats_waiters.clear()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            collector = self._collectors.get(output.request_id)
            if collector is not None:
                collector.put(output)

    def _deliver_refusals(self, refused: dict[str, str]) -> None:
        for request_id, error in refused.items():
            collector = self._collectors.get(request_id)
            if collector is not None:
                collector.fail(ValueError(error))

    async def _watch_daemon(self) -> None:
        while self._daemon.alive():
            await asyncio.sleep(_DAEMON_POLL_S)
        if not self._closed:
            self._on_dead(self._daemon.failure_message("the engine core process exited"))

    def _on_dead(self, reason: str) -> None:
        if self.dead:
            return
        self.dead, self.dead_reason = True, reason
        if not self._closed:
            logger.error("engine core is dead: %s", reason)
        self._deliver(self._processor.fail_all(reason))
        for fut in self._stats_waiters:
            if not fut.done():
                fut.set_exception(RuntimeError(f"the engine core is dead: {reason}"))
        self._stats_waiters.clear()

    # -- shutdown -------------------------------------------------------------------------

    async def close(self) -> None:
        """Detach (Goodbye); stop the daemon if this object started it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._deliver(self._processor.fail_all("the frontend was closed", "abort"))
        await self._client.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._daemon is not None:
            await _in_own_thread(self._daemon.stop)

    @property
    def daemon_pid(self) -> int | None:
        """The private daemon's pid, or None when attached to someone else's."""
        return self._daemon.pid if self._daemon is not None else None

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
