"""GenerateRequest -> what the engine runs: prompt tokens, sampler, limits, stops.

Everything a client can get wrong is checked here, before the engine sees it, and
reported as `RequestError` with the gRPC code the servicer answers with.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

import grpc
from mlx_lm.generate import StopSequences
from mlx_lm.tokenizer_utils import TokenizerWrapper

from services.common.images import ImageError
from services.core.output_prep import OutputPreparer, template_tools
from services.core.sampling import Sampler, SamplingError, make_processors, make_sampler
from services.core.structured_output import GrammarError
from services.core.text_output import OutputSpec
from services.core.vision.prompt_images import ImagePreparer, PromptImages, image_parts, template_content
from services.proto.moemesh.v1 import core_pb2

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_REQUEST_ID_CHARS = 256  # it travels on every chunk and every expert call of the request


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class PreparedRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    processors: list
    stop_sequences: StopSequences
    stop_strings: list[str]
    logprobs: bool
    top_logprobs: int
    deadline: float | None = None  # time.monotonic() deadline
    kv_cache: str = ""  # KV cache kind; "" = the launch default (validated by the servicer)
    # Prompt positions where the prefix cache keeps a snapshot as prefill passes them (the end of
    # a chat's system prompt): caches that cannot be trimmed back (Gated DeltaNet state, sliding
    # windows) are reusable only from such exact points.
    snapshot_at: tuple[int, ...] = ()
    # the logprob of every prompt token given the ones before it (computed in full: no prefix cache)
    prompt_logprobs: bool = False
    score_only: bool = False  # max_tokens 0 with prompt_logprobs: the one token generated is not sent
    output: OutputSpec = field(default_factory=OutputSpec)  # how the output stream is routed
    speculative: bool = True  # may this request's tokens be drafted (when core speculates)
    images: PromptImages | None = None  # a chat's images, their positions expanded in `prompt`
    created: float = field(default_factory=time.time)


# arguments core itself passes to the chat template: a request's template kwargs may not repeat them
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "add_generation_prompt", "continue_final_message", "tokenize"}
)


class RequestPreparer:
    def __init__(
        self,
        tokenizer: TokenizerWrapper,
        model_id: str,
        context_length: int,
        vocab_size: int,
        aliases: tuple[str, ...] = (),
    ):
        """`model_id`: the name the model is served under; `aliases`: other names requests may use."""
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.model_names = (model_id, *aliases)
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.output_preparer = OutputPreparer(tokenizer, vocab_size)
        self.images: ImagePreparer | None = None  # set where the model has a vision tower
        self.images_refused = "takes text only"  # why, where `images` is None
        # No token is longer than the longest vocabulary piece (byte-level pieces have a character
        # per byte), so text longer than this cannot fit the context: it is refused before the
        # tokenizer spends seconds to minutes on it.
        longest_piece = max((len(piece) for piece in tokenizer.get_vocab()), default=1)
        self.max_text_chars = context_length * max(longest_piece, 1)

    def _check_text_fits(self, request: core_pb2.GenerateRequest) -> None:
        """Refuse text that cannot fit the context before tokenizing it. Counting tokens
        (`prompt_tokens` alone) takes any length: that is what counting is for."""
        kind = request.WhichOneof("input")
        if kind == "prompt":
            chars, field = len(request.prompt), "prompt"
        elif kind == "chat":
            chat = request.chat
            chars = sum(
                len(m.content)
                + sum(len(c.arguments) for c in m.tool_calls)
                + sum(len(p.text) for p in m.parts)
                for m in chat.messages
            )
            chars += sum(len(tool.parameters_json) + len(tool.description) for tool in chat.tools)
            field = "chat"
        else:
            return
        if chars > self.max_text_chars:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"context_length_exceeded: {field} has {chars} characters, more than "
                f"{self.context_length} tokens can hold (the model's context)",
            )

    def prompt_tokens(self, request) -> list[int]:
        """Tokens of a GenerateRequest's or CountTokensRequest's input."""
        kind = request.WhichOneof("input")
        if kind == "chat":
            return self._with_images(
                request.chat, self._render_chat(request.chat, self._chat_inputs(request.chat))
            )[0]
        if kind == "prompt":
            if not request.prompt:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "prompt: must not be empty")
            return list(self.tokenizer.encode(request.prompt))
        if kind == "token_ids":
            return self._in_vocabulary(request.token_ids.ids, "token_ids")
        inputs = ", ".join(field.name for field in request.DESCRIPTOR.oneofs_by_name["input"].fields)
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"input: one of {inputs} is required")

    def detokenize(self, ids) -> str:
        """Text of token ids, as the tokenizer decodes them; ids outside the vocabulary are refused."""
        return self.tokenizer.decode(self._in_vocabulary(ids, "ids"))

    def _in_vocabulary(self, ids, field: str) -> list[int]:
        """`ids` as a list; INVALID_ARGUMENT naming `field` and the first id past the vocabulary."""
        ids = list(ids)
        bad = next((i for i in ids if i >= self.vocab_size), None)
        if bad is not None:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{field}: {bad} is outside the vocabulary (size {self.vocab_size})",
            )
        return ids

    def _snapshot_points(
        self, chat: tuple[list[dict], list | None, dict], prompt: list[int]
    ) -> tuple[int, ...]:
        """Where the system prompt of a chat (`_chat_inputs`) ends in `prompt` (as mlx-lm's server
        finds it: the template rendered for the system messages and an empty user turn, compared
        token by token), or () when there is none to find."""
        messages, tools, kwargs = chat
        system = 0
        while system < len(messages) and messages[system]["role"] == "system":
            system += 1
        if system == 0 or messages[-1]["role"] != "user":
            return ()
        try:
            head = self._render(messages[:system] + [{"role": "user", "content": ""}], tools, kwargs, False)
        except RequestError:
            return ()
        end = next((i for i, (a, b) in enumerate(zip(head, prompt, strict=False)) if a != b), 0)
        return (end,) if 0 < end < len(prompt) - 1 else ()

    def _chat_inputs(self, chat: core_pb2.ChatInput) -> tuple[list[dict], list | None, dict]:
        """The chat's messages, tools and template arguments as the chat template takes them."""
        if not chat.messages:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, "chat.messages: at least one message is required"
            )
        if self.images is None and (parts := image_parts(chat)):  # before a text-only template meets parts
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{parts[0][0]}: model {self.model_id!r} {self.images_refused}",
            )
        messages = []
        for index, message in enumerate(chat.messages):
            if message.role not in ("system", "user", "assistant", "tool", "developer"):
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"chat.messages[{index}].role: unknown role {message.role!r}",
                )
            entry: dict = {
                "role": "system" if message.role == "developer" else message.role,
                "content": template_content(message) if message.parts else message.content,
            }
            if message.name:
                entry["name"] = message.name
            if message.tool_call_id:
                entry["tool_call_id"] = message.tool_call_id
            if message.tool_calls:
                entry["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": _json_or_text(c.arguments)},
                    }
                    for c in message.tool_calls
                ]
            messages.append(entry)
        try:
            tools = template_tools(chat)
        except GrammarError as error:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None
        return messages, tools or None, template_kwargs(chat)

    def _render_chat(
        self, chat: core_pb2.ChatInput, inputs: tuple[list[dict], list | None, dict]
    ) -> list[int]:
        """The prompt of a chat: its messages, then the assistant's new turn opened, or with
        `continue_final_message` the final assistant message left open to carry on from."""
        if chat.continue_final_message:
            return self._continuation(*inputs)
        return self._render(*inputs, generation_prompt=True)

    def _continuation(self, messages: list[dict], tools: list | None, kwargs: dict) -> list[int]:
        """The conversation rendered up to the end of the final assistant message's text, as
        Hugging Face's `continue_final_message` does it: render the whole conversation as text,
        cut right after the last occurrence of that text (the template's end-of-turn goes), then
        tokenize. Done here rather than by the template call because not every tokenizer wrapper
        takes that flag."""
        final = messages[-1]
        if final["role"] != "assistant":
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"chat.continue_final_message: the last message is a {final['role']} turn, not an assistant turn",
            )
        if final.get("tool_calls"):
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "chat.continue_final_message: the final assistant message calls tools; only text can be continued",
            )
        content = final["content"] or ""
        text = content.strip()
        if not text:  # nothing to carry on from: an empty prefill is a new turn
            return self._render(messages[:-1], tools, kwargs, generation_prompt=True)
        rendered = self._template(messages, tools, kwargs, generation_prompt=False, tokenize=False)
        start = rendered.rfind(text)
        if start < 0:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "chat.continue_final_message: this model's chat template does not render the final "
                "assistant message's text as given, so it cannot be continued",
            )
        # trailing whitespace stays where the template kept it (as Hugging Face cuts it)
        kept = content.lstrip()
        end = start + (len(kept) if rendered[start : start + len(kept)] == kept else len(text))
        return list(self.tokenizer.encode(rendered[:end], add_special_tokens=False))

    def _render(
        self, messages: list[dict], tools: list | None, kwargs: dict, generation_prompt: bool
    ) -> list[int]:
        tokens = self._template(messages, tools, kwargs, generation_prompt=generation_prompt, tokenize=True)
        if isinstance(tokens, dict) or hasattr(tokens, "input_ids"):
            tokens = tokens["input_ids"]
        return list(tokens)

    def _template(self, messages, tools, kwargs, generation_prompt: bool, tokenize: bool):
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=tokenize, **kwargs
            )
        except Exception as error:  # noqa: BLE001 - jinja raises anything for conversations the template refuses
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"chat template: {error}") from None

    def _with_images(
        self, chat: core_pb2.ChatInput, prompt: list[int]
    ) -> tuple[list[int], PromptImages | None]:
        """The prompt with its images' positions, and the images (None: none; `_chat_inputs` refuses)."""
        if not (parts := image_parts(chat)):
            return prompt, None
        try:
            return self.images.prepare(parts, prompt)
        except ImageError as error:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None

    def check_model(self, model: str) -> None:
        """A request naming a model must name the served one or an alias (empty: whatever is served)."""
        if model and model not in self.model_names:
            serving = ", ".join(repr(name) for name in self.model_names)
            raise RequestError(
                grpc.StatusCode.NOT_FOUND, f"model {model!r} is not served here (serving {serving})"
            )

    def prepare(self, request: core_pb2.GenerateRequest, deadline: float | None) -> PreparedRequest:
        """`deadline`: time.monotonic() by which the request must be done (None: no deadline)."""
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, f"request_id: at most {MAX_REQUEST_ID_CHARS} characters"
            )
        self.check_model(request.model)
        self._check_text_fits(request)
        chat = self._chat_inputs(request.chat) if request.WhichOneof("input") == "chat" else None
        prompt, images = (
            self._with_images(request.chat, self._render_chat(request.chat, chat))
            if chat
            else (self.prompt_tokens(request), None)
        )
        if images is not None and request.prompt_logprobs:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "prompt_logprobs: not available with images")
        if not prompt:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, "input: the prompt is empty after tokenization"
            )
        room = self.context_length - len(prompt)
        if room <= 0:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"context_length_exceeded: the prompt has {len(prompt)} tokens, the model's context is {self.context_length}",
            )
        stopping = request.stopping
        score_only = request.prompt_logprobs and stopping.HasField("max_tokens") and stopping.max_tokens == 0
        if score_only:
            max_tokens = 1  # mlx-lm's generator computes one; it is not sent
        elif stopping.HasField("max_tokens"):
            if stopping.max_tokens < 1:
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "max_tokens: must be at least 1 (0 only with prompt_logprobs, to score the prompt)",
                )
            if stopping.max_tokens > room:
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"context_length_exceeded: {len(prompt)} prompt tokens + max_tokens {stopping.max_tokens} "
                    f"exceed the model's context of {self.context_length}",
                )
            max_tokens = stopping.max_tokens
        else:
            max_tokens = room
        if len(stopping.stop) > MAX_STOP_STRINGS:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, f"stop: at most {MAX_STOP_STRINGS} stop strings"
            )
        stop_ids = [[int(t)] for t in self._in_vocabulary(stopping.stop_token_ids, "stop_token_ids")]
        if not stopping.ignore_eos:
            stop_ids += [[int(t)] for t in sorted(self.tokenizer.eos_token_ids)]
        if request.top_logprobs > MAX_TOP_LOGPROBS:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"top_logprobs: at most {MAX_TOP_LOGPROBS}")
        try:
            sampler = make_sampler(request.sampling, self.vocab_size)
            processors = make_processors(request.sampling, self.vocab_size)
        except SamplingError as error:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {error}") from None
        try:
            output, constraints = self.output_preparer.prepare(request, prompt, list(stopping.stop))
        except GrammarError as error:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None
        return PreparedRequest(
            request_id=request.request_id or uuid.uuid4().hex,
            prompt=prompt,
            max_tokens=max_tokens,
            sampler=sampler,
            processors=processors + constraints,  # the grammar's mask last: nothing may undo it
            stop_sequences=StopSequences(stop_ids or None),
            stop_strings=list(stopping.stop),
            output=output,
            logprobs=request.logprobs or request.top_logprobs > 0,
            top_logprobs=request.top_logprobs,
            deadline=deadline,
            speculative=not request.HasField("speculative") or request.speculative,
            snapshot_at=self._snapshot_points(chat, prompt) if chat and images is None else (),
            images=images,
            prompt_logprobs=request.prompt_logprobs,
            score_only=score_only,
        )


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return text


def template_kwargs(chat: core_pb2.ChatInput) -> dict:
    """The request's extra chat-template arguments (a JSON object, none of core's own)."""
    try:
        kwargs = json.loads(chat.template_kwargs_json) if chat.template_kwargs_json else {}
    except json.JSONDecodeError as error:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"chat.template_kwargs_json: {error}") from None
    if not isinstance(kwargs, dict):
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT, "chat.template_kwargs_json: must be a JSON object"
        )
    reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"chat.template_kwargs_json: {', '.join(reserved)} cannot be set here (the request's own fields set them)",
        )
    return kwargs
