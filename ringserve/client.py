"""An async client for a ringserve server, on aiohttp.

    async with AsyncClient("http://127.0.0.1:8000") as client:
        done = await client.complete("Once upon a time", max_tokens=32, temperature=0)
        print(done.text, done.finish_reason, done.usage)
        async for text in client.stream([{"role": "user", "content": "Hi"}]):
            print(text, end="")

Keyword parameters are the API's own fields (`max_tokens`, `temperature`,
`stop`, `seed`, ...) and are sent as given. Every failure raises `ApiError`:
a refusal with the server's status, message, code and headers (a 429's
`Retry-After`); an error reported in the middle of a stream (the status
line already sent as 200) with status 500 and the server's code; and
`ConnectionFailed`, an `ApiError` too, when the server cannot be reached
(503), stops answering for `timeout_s` (504), or drops the connection or
answers with something that is not the API's (502) before the answer is
whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, TypeVar

import aiohttp
import msgspec

from ringserve.http.errors import ApiError, ErrorBody
from ringserve.http.responses import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    Generation,
    Health,
    ModelList,
)
from ringserve.http.sse import data_payloads

__all__ = [
    "ApiError",
    "AsyncClient",
    "ConnectionFailed",
    "ChatCompletion",
    "Completion",
    "Generation",
    "Health",
]

T = TypeVar("T")
Messages = Sequence[dict[str, Any]]


class ConnectionFailed(ApiError):
    """No whole answer came from the server: it could not be reached (503),
    went quiet for longer than the client's timeout (504), or dropped the
    connection or sent what is not the API's answer (502)."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(status, message, code=code)


@contextlib.contextmanager
def _answering(url: str) -> Iterator[None]:
    """Transport failures of a request to `url` as `ConnectionFailed`."""
    try:
        yield
    except aiohttp.ClientConnectorError as exc:
        raise ConnectionFailed(503, f"cannot reach {url}: {exc.os_error}", "unreachable") from exc
    except (aiohttp.ServerTimeoutError, TimeoutError) as exc:
        raise ConnectionFailed(504, f"{url} did not answer in time", "timeout") from exc
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
        why = str(exc) or type(exc).__name__
        raise ConnectionFailed(502, f"the answer from {url} broke off: {why}", "broken") from exc
    except msgspec.DecodeError as exc:  # ValidationError included
        raise ConnectionFailed(
            502, f"{url} answered what is not the API's: {exc}", "bad_answer"
        ) from exc


class AsyncClient:
    """One aiohttp session to one server, opened on first use; `timeout_s`
    bounds connecting and every wait for the server's next bytes (a long
    stream is fine as long as tokens keep coming)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout_s: float = 300.0,
        model: str | None = None,
    ) -> None:
        base = base_url.rstrip("/")
        # the openai package's form (".../v1") names the same server
        self.base_url = base.removesuffix("/v1")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.model = model
        self._session: aiohttp.ClientSession | None = None
        self._streams: set[aiohttp.ClientResponse] = set()  # being read by `stream`

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the session; a stream another task is reading raises
        `ConnectionFailed` (its request is aborted). A later call opens a
        new session."""
        for resp in list(self._streams):
            resp.content.set_exception(aiohttp.ClientConnectionError("the client was closed"))
            resp.close()
        self._streams.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ---- the API ---------------------------------------------------------------

    async def complete(self, prompt: str | Sequence[int], **params: Any) -> Completion:
        _not_streamed(params)
        body = self._body(prompt=_prompt(prompt), **params)
        return await self._post("/v1/completions", body, Completion)

    async def chat(self, messages: Messages, **params: Any) -> ChatCompletion:
        _not_streamed(params)
        body = self._body(messages=list(messages), **params)
        return await self._post("/v1/chat/completions", body, ChatCompletion)

    async def stream(
        self, prompt: str | Sequence[int] | Messages, **params: Any
    ) -> AsyncIterator[str]:
        """Text deltas of one choice: a completion for a string or token ids,
        a chat completion for a list of messages. To stop early, iterate
        under `contextlib.aclosing`: closing the stream drops the connection,
        and the server aborts the request."""
        if params.get("n") not in (None, 1):
            raise ValueError("stream() follows one choice; use n=1")
        if params.get("tools") and params.get("tool_choice") != "none":
            raise ValueError("stream() yields text, and a tool call is not text: use chat()")
        chat = _is_messages(prompt)
        if chat:
            path, body = "/v1/chat/completions", self._body(messages=list(prompt), **params)
        else:
            path, body = "/v1/completions", self._body(prompt=_prompt(prompt), **params)
        body["stream"] = True
        # Closing this generator early closes the connection, which aborts
        # the request on the server.
        async with contextlib.aclosing(self._events(path, body)) as events:
            async for event in events:
                with _answering(self.base_url + path):
                    text = _chunk_text(event, chat)
                if text:
                    yield text

    async def generate(self, input_ids: Sequence[int], **sampling: Any) -> Generation:
        body = {"input_ids": list(input_ids), "sampling_params": sampling}
        return await self._post("/generate", body, Generation)

    async def health(self) -> Health:
        """The server's health; unhealthy (503) is an answer, not an error."""
        url = self.base_url + "/health"
        with _answering(url):
            async with self._http().get(url) as resp:
                raw = await resp.read()
                if resp.status not in (200, 503):
                    raise _error(resp, raw)
                return msgspec.json.decode(raw, type=Health)

    async def models(self) -> list[str]:
        listing = await self._get("/v1/models", ModelList)
        return [card.id for card in listing.data]

    # ---- plumbing ----------------------------------------------------------------

    def _body(self, **fields: Any) -> dict[str, Any]:
        if self.model is not None:
            fields.setdefault("model", self.model)
        return fields

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            headers = {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}
            timeout = aiohttp.ClientTimeout(
                total=None, sock_connect=self.timeout_s, sock_read=self.timeout_s
            )
            self._session = aiohttp.ClientSession(headers=headers, timeout=timeout)
        return self._session

    async def _post(self, path: str, body: dict[str, Any], kind: type[T]) -> T:
        data = msgspec.json.encode(body)
        headers = {"Content-Type": "application/json"}
        url = self.base_url + path
        with _answering(url):
            async with self._http().post(url, data=data, headers=headers) as resp:
                return _decode(resp, await resp.read(), kind)

    async def _get(self, path: str, kind: type[T]) -> T:
        url = self.base_url + path
        with _answering(url):
            async with self._http().get(url) as resp:
                return _decode(resp, await resp.read(), kind)

    async def _events(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The JSON events of a server-sent stream, up to [DONE]."""
        data = msgspec.json.encode(body)
        headers = {"Content-Type": "application/json"}
        url = self.base_url + path
        with _answering(url):
            async with self._http().post(url, data=data, headers=headers) as resp:
                if resp.status != 200:
                    raise _error(resp, await resp.read())
                self._streams.add(resp)
                try:
                    async for payload in data_payloads(resp.content.iter_any()):
                        if payload == b"[DONE]":
                            return
                        event = msgspec.json.decode(payload)
                        if not isinstance(event, dict):
                            raise msgspec.ValidationError(f"an event of {type(event).__name__}")
                        if "error" in event:
                            raise _error(None, payload)
                        yield event
                finally:
                    self._streams.discard(resp)
        raise ConnectionFailed(502, f"the stream from {url} ended without [DONE]", "broken")


def _not_streamed(params: dict[str, Any]) -> None:
    if params.get("stream"):
        raise ValueError("stream=True: use stream(), which yields the text as it comes")


def _chunk_text(event: dict[str, Any], chat: bool) -> str | None:
    if chat:
        chunk = msgspec.convert(event, ChatCompletionChunk)
        return chunk.choices[0].delta.content if chunk.choices else None
    completion = msgspec.convert(event, Completion)
    return completion.choices[0].text if completion.choices else None


def _decode(resp: aiohttp.ClientResponse, raw: bytes, kind: type[T]) -> T:
    if resp.status != 200:
        raise _error(resp, raw)
    return msgspec.json.decode(raw, type=kind)  # DecodeError: not the API's (see _answering)


def _error(resp: aiohttp.ClientResponse | None, raw: bytes) -> ApiError:
    """The server's refusal (`resp` None: an error event of a stream, 500)."""
    status = 500 if resp is None else resp.status
    kept = {} if resp is None else {k: resp.headers[k] for k in _KEPT_HEADERS if k in resp.headers}
    try:
        detail = msgspec.json.decode(raw, type=ErrorBody).error
    except msgspec.DecodeError:
        text = raw.decode(errors="replace") or f"HTTP {status}"
        return ApiError(status, text, headers=kept)
    return ApiError(
        status,
        detail.message,
        type=detail.type,
        param=detail.param,
        code=detail.code,
        headers=kept,
    )


_KEPT_HEADERS = ("Retry-After",)  # what a caller acts on


def _prompt(prompt: str | Sequence[int]) -> str | list[int]:
    return prompt if isinstance(prompt, str) else [int(t) for t in prompt]


def _is_messages(prompt: object) -> bool:
    return (
        not isinstance(prompt, str)
        and isinstance(prompt, Sequence)
        and len(prompt) > 0
        and isinstance(prompt[0], dict)
    )
