"""DeepSeek's deepseek-recipe Python API (github.com/deepseek-ai/deepseek-recipe), on this package's C++ core.

The same names and calls as deepseek-recipe's `deepseek_recipe` module, for code written against it:

    converted = ChatCompletionRequest(body).convert(ConversionOptions())     # or ResponsesRequest, MessagesRequest
    rendered = DeepseekV41Encoding().render_conversation(converted.conversation)
    rendered.prompt
    DeepseekV41Encoding().with_tokenizer(tokenizer).encode(converted.conversation)   # token ids
    generator = ChatCompletionRequest.chunk_generator(converted, "id-1", "deepseek-flash")
    processor = StreamProcessor(generator, converted.parsing_options)        # tokenizer as a third argument for ids
    for chunk in backend:                                                    # InferenceChunk.ready/text/token/finish
        for output in processor.push(chunk): send(output.to_json())
    processor.finish()

Nothing here renders, parses or builds a response: requests convert through the recipe's converters
(Conversation.from_openai / from_anthropic / from_responses), prompts render through its renderers, and
StreamProcessor is a ResponseStream (the recipe's output parser, stop strings and response builders, exactly what
`deepinfer serve` runs). Where this package deliberately differs from deepseek-recipe, docs/deepseek-recipe-parity.md
says so, with the test that shows it.
"""
import enum
import re
import time

from . import _core, _models
from ._core import Conversation, ResponseStream, Tokenizer, ToolCall

# Marker texts (deepseek-recipe exports them under these names).
BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
SYSTEM_SP_TOKEN = "<｜System｜>"
USER_SP_TOKEN = "<｜User｜>"
ASSISTANT_SP_TOKEN = "<｜Assistant｜>"
LATEST_REMINDER_SP_TOKEN = "<｜latest_reminder｜>"
THINKING_START_TOKEN = "<think>"
THINKING_END_TOKEN = "</think>"
DSML_SP_TOKEN = "｜DSML｜"
# The V4.1 image placeholder as DeepSeek's reference encoder (encoding_dsv41.py) writes it, and its id in the
# V4.1 tokenizer; deepseek-recipe's constant is "<｜image｜>" (docs/deepseek-recipe-parity.md).
IMAGE_SPECIAL_TOKEN = "<｜deepseek_image｜>"
IMAGE_SPECIAL_TOKEN_ID = 129264

DEFAULT_FORMAT = "deepseek-v4.1"


class ConversionError(ValueError):
    """A request the converters refuse. `status_code` (400) and `body` (the JSON error body in the request's
    dialect, as `deepinfer serve` writes it) are what a server returns."""

    def __init__(self, message, dialect="chat_completions", param=""):
        super().__init__(message)
        self.status_code = 400
        self.body = _core.error_body(400, message, param, "", dialect)


# ---- conversation types ------------------------------------------------------------------------------------

class Message:
    """A conversation message; `to_openai()` is its OpenAI Chat Completions dict."""

    role = None

    def __init__(self, content=None):
        self.content = content

    def to_openai(self):
        return {"role": self.role, "content": self.content}

    def __eq__(self, other):
        return type(self) is type(other) and self.to_openai() == other.to_openai()

    def __repr__(self):
        return "%s(%r)" % (type(self).__name__, self.content)


class SystemMessage(Message):
    role = "system"


class DeveloperMessage(Message):
    role = "developer"


class UserMessage(Message):
    role = "user"


class LatestReminderMessage(Message):
    role = "latest_reminder"


class AssistantMessage(Message):
    role = "assistant"

    def __init__(self, content=None, reasoning_content=None, tool_calls=None, prefix=False):
        super().__init__(content)
        self.reasoning_content = reasoning_content
        self.tool_calls = list(tool_calls or [])
        self.prefix = prefix

    def to_openai(self):
        out = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [call.to_openai() if hasattr(call, "to_openai") else call for call in self.tool_calls]
        if self.prefix:
            out["prefix"] = True
        return out


class ToolMessage(Message):
    role = "tool"

    def __init__(self, content=None, tool_call_id=""):
        super().__init__(content)
        self.tool_call_id = tool_call_id

    def to_openai(self):
        return {"role": "tool", "content": self.content, "tool_call_id": self.tool_call_id}


_MESSAGE_TYPES = {cls.role: cls for cls in (SystemMessage, DeveloperMessage, UserMessage, LatestReminderMessage)}


def message_from_openai(message):
    """The message object of an OpenAI message dict (what Conversation.messages returns)."""
    role = message["role"]
    if role == "assistant":
        calls = [ToolCall(call["function"]["name"], call["function"]["arguments"], call.get("id"))
                 for call in message.get("tool_calls", [])]
        return AssistantMessage(message.get("content"), message.get("reasoning_content"), calls,
                                message.get("prefix", False))
    if role == "tool":
        return ToolMessage(message.get("content"), message.get("tool_call_id", ""))
    return _MESSAGE_TYPES[role](message.get("content"))


class ToolDefinition:
    """A function the model may call. `parameters` is a JSON Schema (a checked copy: a circular reference is a
    ValueError, nesting past 128 levels a RecursionError)."""

    def __init__(self, name, description=None, parameters=None, strict=None):
        self.name = name
        self.description = description
        self.parameters = None if parameters is None else _core.json_value(parameters)
        self.strict = strict

    def to_openai(self):
        function = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}

    def __eq__(self, other):
        return isinstance(other, ToolDefinition) and self.to_openai() == other.to_openai()

    def __repr__(self):
        return "ToolDefinition(name=%r)" % self.name


def tool_from_function(function):
    return ToolDefinition(function["name"], function.get("description"), function.get("parameters"),
                          function.get("strict"))


# ---- conversion --------------------------------------------------------------------------------------------

class WebSearchBehavior(enum.Enum):
    """What conversion does with a server-side web_search tool declaration: drop it, or refuse the request."""
    Ignore = "ignore"
    Reject = "reject"


class ConversionOptions:
    """Conversion defaults. default_thinking_mode: thinking mode for a request that does not say (deepseek-recipe's
    default: on). responses_web_search / messages_web_search: what a web_search server tool does (defaults: Ignore
    for Responses, Reject for Messages). format (this package's addition): the prompt format whose output the
    parsing options describe (deepseek-v4.1 by default; deepseek-v4 for DeepseekV4Encoding)."""

    def __init__(self, default_thinking_mode=True, responses_web_search=WebSearchBehavior.Ignore,
                 messages_web_search=WebSearchBehavior.Reject, format=DEFAULT_FORMAT):
        self.default_thinking_mode = default_thinking_mode
        self.responses_web_search = responses_web_search
        self.messages_web_search = messages_web_search
        self.format = format

    def _with(self, **changes):
        values = dict(vars(self))
        values.update(changes)
        return ConversionOptions(**values)

    def with_default_thinking_mode(self, enabled):
        return self._with(default_thinking_mode=enabled)

    def with_responses_web_search(self, behavior):
        return self._with(responses_web_search=behavior)

    def with_messages_web_search(self, behavior):
        return self._with(messages_web_search=behavior)

    def with_format(self, format):
        return self._with(format=format)


class ReasoningStage(enum.Enum):
    """Where output parsing starts: Start and Reasoning start inside reasoning, Content in the answer."""
    Start = "start"
    Reasoning = "reasoning"
    Content = "content"


class ParsingOptions:
    """How the model's output is read. parse_tool_calls: recognise tool-call markup (else it is content).
    tool_call_initial_stage: the prompt pre-filled the tool-call block's opener (tool_choice required or named), so
    the output starts inside the block; takes precedence over reasoning_initial_stage and needs parse_tool_calls.
    parse_json_output: the request asked for JSON (response_format): the answer keeps only its JSON text.
    reasoning_initial_stage: ReasoningStage.Start/Reasoning when the prompt opened <think>. stop_sequences: the
    request's stop strings. format: the prompt format (this package's parser is per format)."""

    def __init__(self, parse_tool_calls=True, tool_call_initial_stage=False, parse_json_output=False,
                 reasoning_initial_stage=None, stop_sequences=None, format=DEFAULT_FORMAT):
        self.parse_tool_calls = parse_tool_calls
        self.tool_call_initial_stage = tool_call_initial_stage
        self.parse_json_output = parse_json_output
        self.reasoning_initial_stage = reasoning_initial_stage
        self.stop_sequences = list(stop_sequences or [])
        self.format = format


class InferenceOptions:
    """The sampling settings of a request, for the backend (unset: None)."""

    def __init__(self, temperature=None, top_p=None, max_tokens=None, stop_sequences=None):
        self.temperature = temperature
        self.top_p = top_p
        self.max_tokens = max_tokens
        self.stop_sequences = list(stop_sequences or [])


class ConversationRequest:
    """What convert() returns: the conversation, the backend's settings, the output parsing settings, and the
    request's model and stream flag."""

    def __init__(self, conversation, inference_options, parsing_options, model, stream, _request):
        self.conversation = conversation
        self.inference_options = inference_options
        self.parsing_options = parsing_options
        self.model = model
        self.stream = stream
        self._request = _request


def _number(body, key, dialect):
    value = body.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConversionError("%s must be a number" % key, dialect, key)
    return value


def _stop_list(body, key, dialect):
    value = body.get(key)
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return [item for item in value if item]
    raise ConversionError("%s must be a string or an array of strings" % key, dialect, key)


def _named_tool(tool_choice):
    """The function name of a named tool_choice as Conversation.tool_choice gives it."""
    return tool_choice["function"]["name"] if isinstance(tool_choice, dict) else tool_choice


_PATH = re.compile(r"^([A-Za-z_][\w.\[\]]*)[: ]")


class _Request:
    """What the three request classes share: the checked body, conversion, and the chunk generator."""

    _dialect = None
    _max_tokens_keys = ()
    _stop_key = None

    def __init__(self, body):
        # A checked copy as plain JSON values (JSON text is parsed; a cycle is a ValueError).
        self._body = _core.json_value(body)
        if not isinstance(self._body, dict):
            raise ValueError("the request body must be a JSON object, got %s" % type(self._body).__name__)

    @property
    def model(self):
        return self._body.get("model")

    @property
    def stream(self):
        return bool(self._body.get("stream", False))

    def _error(self, error):
        message = str(error)
        match = _PATH.match(message)
        param = match.group(1) if match and re.split(r"[.\[]", match.group(1))[0] in self._body else ""
        return ConversionError(message, self._dialect, param)

    def convert(self, options=None):
        options = options if options is not None else ConversionOptions()
        body = self._server_tools(self._body, options)
        try:
            conversation = self._parse(body)
        except ValueError as error:
            raise self._error(error) from None
        thinking_by_default = not self._says_thinking(body)
        if thinking_by_default:
            conversation.set_reasoning_mode(options.default_thinking_mode)
        max_tokens = None
        for key in self._max_tokens_keys:
            if body.get(key) is not None:
                max_tokens = body[key]
                break
        stops = _stop_list(body, self._stop_key, self._dialect) if self._stop_key else []
        inference = InferenceOptions(_number(body, "temperature", self._dialect), _number(body, "top_p", self._dialect),
                                     max_tokens, stops)
        # A forced tool_choice pre-fills the tool-call block after the generation prompt (the DSML formats; the
        # others refuse it when rendering), so parsing starts inside the block: the options the server derives
        # from the rendered prompt (recipe::stream_parser_options).
        forced_tool_call = conversation.tool_choice != "auto"
        if forced_tool_call and conversation.thinking_mode:
            what = ("requiring a tool call" if conversation.tool_choice == "required" else
                    "naming the function %r" % _named_tool(conversation.tool_choice))
            remedy = ("disable thinking in the request, or convert with ConversionOptions(default_thinking_mode="
                      "False) (the request does not say, and thinking is on by default)" if thinking_by_default else
                      "disable thinking")
            raise ConversionError(
                "tool_choice %s cannot be combined with thinking: the prompt pre-fills the tool-call block where the "
                "reasoning would start; %s, or use tool_choice \"auto\"" % (what, remedy), self._dialect, "tool_choice")
        parsing = ParsingOptions(
            parse_tool_calls=bool(conversation.tool_names),
            tool_call_initial_stage=forced_tool_call,
            parse_json_output=conversation.response_format is not None,
            reasoning_initial_stage=ReasoningStage.Start if conversation.thinking_mode else None,
            stop_sequences=stops,
            format=options.format)
        return ConversationRequest(conversation, inference, parsing, self.model, self.stream, self)

    def _server_tools(self, body, options):
        return body

    @classmethod
    def chunk_generator(cls, converted, response_id, model):
        """The chunk generator of a response to `converted` (a ConversationRequest) with this id and model."""
        return cls._generator(converted, response_id, model)


class ChatCompletionRequest(_Request):
    """An OpenAI Chat Completions request body (dict, or JSON text)."""

    _dialect = "chat_completions"
    _max_tokens_keys = ("max_completion_tokens", "max_tokens")
    _stop_key = "stop"

    def _parse(self, body):
        return Conversation.from_openai(body)

    def _says_thinking(self, body):
        kwargs = body.get("chat_template_kwargs")
        return body.get("thinking") is not None or (
            isinstance(kwargs, dict) and any(kwargs.get(key) is not None for key in ("thinking", "enable_thinking")))

    def include_usage(self):
        """stream_options.include_usage."""
        options = self._body.get("stream_options")
        return bool(isinstance(options, dict) and options.get("include_usage"))

    @staticmethod
    def _generator(converted, response_id, model):
        return ChatCompletionChunkGenerator(response_id, model)


def _web_search(tool):
    return isinstance(tool, dict) and str(tool.get("type", "")).startswith("web_search")


def _filter_server_tools(body, behavior, dialect):
    tools = body.get("tools")
    if not isinstance(tools, list) or not any(_web_search(tool) for tool in tools):
        return body
    if behavior == WebSearchBehavior.Reject:
        index = next(i for i, tool in enumerate(tools) if _web_search(tool))
        raise ConversionError("tools[%d] (%s): server tools are not supported; WebSearchBehavior.Ignore drops them"
                              % (index, tools[index]["type"]), dialect, "tools[%d]" % index)
    body = dict(body)
    body["tools"] = [tool for tool in tools if not _web_search(tool)]
    return body


class ResponsesRequest(_Request):
    """An OpenAI Responses request body (dict, or JSON text)."""

    _dialect = "responses"
    _max_tokens_keys = ("max_output_tokens",)

    def _parse(self, body):
        return Conversation.from_responses(body)

    def _says_thinking(self, body):
        return body.get("reasoning") is not None

    def _server_tools(self, body, options):
        return _filter_server_tools(body, options.responses_web_search, self._dialect)

    def custom_tool_names(self):
        """Names of the request's custom tools (refused by conversion: only function tools are supported)."""
        return [tool.get("name") for tool in self._body.get("tools") or [] if isinstance(tool, dict) and
                tool.get("type") == "custom"]

    @staticmethod
    def _generator(converted, response_id, model):
        body = converted._request._body
        inference = converted.inference_options
        echo = _core.responses_echo(
            body, inference.max_tokens, bool(body.get("parallel_tool_calls", True)),
            1.0 if inference.temperature is None else float(inference.temperature),
            1.0 if inference.top_p is None else float(inference.top_p))
        return ResponsesChunkGenerator(response_id, model, echo)


class MessagesRequest(_Request):
    """An Anthropic Messages request body (dict, or JSON text)."""

    _dialect = "messages"
    _max_tokens_keys = ("max_tokens",)
    _stop_key = "stop_sequences"

    def _parse(self, body):
        return Conversation.from_anthropic(body)

    def _says_thinking(self, body):
        return body.get("thinking") is not None

    def _server_tools(self, body, options):
        return _filter_server_tools(body, options.messages_web_search, self._dialect)

    @staticmethod
    def _generator(converted, response_id, model):
        return MessagesChunkGenerator(response_id, model)


# ---- prompts -----------------------------------------------------------------------------------------------

class RenderedPrompt:
    """A rendered prompt: `prompt` (text) and `image_sources` (the images' URLs or data: URIs, in order)."""

    def __init__(self, prompt, image_sources):
        self.prompt = prompt
        self.image_sources = image_sources

    def __repr__(self):
        return "RenderedPrompt(%d chars, %d images)" % (len(self.prompt), len(self.image_sources))


class _Encoding:
    format = None

    def __init__(self, tokenizer=None):
        if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
            raise TypeError("tokenizer must be a deepseek_recipe.Tokenizer, got %s" % type(tokenizer).__name__)
        self._tokenizer = tokenizer

    def with_tokenizer(self, tokenizer):
        """The same encoding with `tokenizer` attached, for encode()."""
        return type(self)(tokenizer)

    def render_conversation(self, conversation):
        """The prompt text and image sources. With a tokenizer attached, marker text in request text (｜DSML｜,
        <tool_result>, ...) is ordinary text when it has the ｜DSML｜ token (DeepSeek-V4's and V4.1's); without one,
        or with one that lacks the token (the DeepSeek-V3 tokenizer this package ships), such text is a ValueError
        naming the field, since that tokenizer could not tell it from the prompt's markup."""
        text, images, _ = conversation.render_text(self.format, self._tokenizer)
        return RenderedPrompt(text, images)

    def encode(self, conversation):
        """The prompt's token ids (control markers as their ids, request text tokenized untrusted)."""
        if self._tokenizer is None:
            raise RuntimeError("this encoding has no tokenizer: use with_tokenizer(tokenizer) before encode()")
        return conversation.render_for_engine(self._tokenizer, format=self.format).token_ids


class DeepseekV41Encoding(_Encoding):
    """DeepSeek V4.1's prompt format (deepseek-v4.1)."""
    format = "deepseek-v4.1"


class DeepseekV4Encoding(_Encoding):
    """DeepSeek V4's prompt format (deepseek-v4, the 0731 revision unless the conversation says preview)."""
    format = "deepseek-v4"


# ---- streaming ---------------------------------------------------------------------------------------------

class PromptUsage:
    """Prompt-side token counts a backend reports (prompt_tokens includes the cache hits)."""

    def __init__(self, prompt_tokens=0, prompt_cache_hit_tokens=0):
        self.prompt_tokens = prompt_tokens
        self.prompt_cache_hit_tokens = prompt_cache_hit_tokens


class InferenceFinishReason(enum.Enum):
    Stop = "stop"
    Length = "length"


class InferenceChunk:
    """What a backend reports: ready() once, text() or token() per piece of output, finish() at the end."""

    def __init__(self, kind, **fields):
        self.kind = kind
        self.__dict__.update(fields)

    @staticmethod
    def ready(system_fingerprint=None, prompt_usage=None):
        return InferenceChunk("ready", system_fingerprint=system_fingerprint,
                              prompt_usage=prompt_usage if prompt_usage is not None else PromptUsage())

    @staticmethod
    def text(content, content_tokens=0):
        return InferenceChunk("text", content=content, content_tokens=content_tokens)

    @staticmethod
    def token(token_id):
        return InferenceChunk("token", token_id=token_id)

    @staticmethod
    def finish(finish_reason=InferenceFinishReason.Stop):
        return InferenceChunk("finish", finish_reason=finish_reason)

    def __repr__(self):
        return "InferenceChunk.%s(%s)" % (self.kind, ", ".join(
            "%s=%r" % item for item in vars(self).items() if item[0] != "kind"))


class _ChunkGenerator:
    """Which response a StreamProcessor builds: dialect, id, model, created."""

    _dialect = None

    def __init__(self, response_id, model, echo=None, include_usage=False):
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.echo = echo
        self.include_usage = include_usage


class ChatCompletionChunkGenerator(_ChunkGenerator):
    _dialect = "chat_completions"

    def with_include_usage(self, include_usage):
        """The same generator with stream_options.include_usage."""
        return ChatCompletionChunkGenerator(self.response_id, self.model, include_usage=bool(include_usage))


class ResponsesChunkGenerator(_ChunkGenerator):
    _dialect = "responses"

    def with_custom_tool_names(self, names):
        """Accepted for compatibility: custom tools are refused at conversion, so there are none to name."""
        return self


class MessagesChunkGenerator(_ChunkGenerator):
    _dialect = "messages"


class _Chunk:
    """One output chunk: to_json() is its JSON text; `event` its SSE event name (None for Chat Completions)."""

    def __init__(self, chunk, stream):
        self._chunk = chunk
        self._stream = stream

    @property
    def event(self):
        return self._chunk.event

    @property
    def data(self):
        return self._chunk.data

    def to_json(self):
        return self._chunk.to_json()

    def to_sse(self):
        return self._chunk.to_sse()

    def __repr__(self):
        return "%s(%s)" % (type(self).__name__, self._chunk.to_json()[:80])


class ChatCompletionChunk(_Chunk):
    pass


class ResponsesStreamEvent(_Chunk):
    pass


class MessagesStreamEvent(_Chunk):
    pass


_CHUNK_TYPES = {"chat_completions": ChatCompletionChunk, "responses": ResponsesStreamEvent,
                "messages": MessagesStreamEvent}


class StreamProcessor:
    """Backend output -> protocol chunks: StreamProcessor(generator, parsing_options, tokenizer=None). push() takes
    one InferenceChunk and returns the chunks it completed; finish() ends the response (as a Stop when no finish
    chunk came). Token chunks need the tokenizer; text chunks without one use the DeepSeek-V3 tokenizer shipped in
    this package (text only needs to round-trip). OpenAI's [DONE] line is not a chunk: see done_message()."""

    def __init__(self, generator, parsing_options, tokenizer=None):
        if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
            raise TypeError("tokenizer must be a deepseek_recipe.Tokenizer, got %s" % type(tokenizer).__name__)
        if parsing_options.tool_call_initial_stage and not parsing_options.parse_tool_calls:
            raise ValueError("tool_call_initial_stage (the prompt pre-filled the tool-call block) needs "
                             "parse_tool_calls: without it the block's markup would be read as text")
        self._has_tokenizer = tokenizer is not None
        if tokenizer is None:
            tokenizer = _models.load_tokenizer("deepseek-ai/DeepSeek-V3")
        stage = parsing_options.reasoning_initial_stage
        self._dialect = generator._dialect
        self._stream = ResponseStream(
            generator._dialect, id=generator.response_id, model=generator.model, created=generator.created,
            tokenizer_model=tokenizer, format=parsing_options.format,
            starts_in_reasoning=stage in (ReasoningStage.Start, ReasoningStage.Reasoning),
            tools=parsing_options.parse_tool_calls, starts_in_tool_calls=parsing_options.tool_call_initial_stage,
            json_output=parsing_options.parse_json_output, stop=parsing_options.stop_sequences,
            include_usage=generator.include_usage, echo=generator.echo)

    def _wrap(self, chunks):
        kind = _CHUNK_TYPES[self._dialect]
        return [kind(chunk, self._stream) for chunk in chunks if not chunk.done]

    def push(self, chunk):
        if chunk.kind == "ready":
            usage = chunk.prompt_usage
            return self._wrap(self._stream.start(usage.prompt_tokens, usage.prompt_cache_hit_tokens))
        if chunk.kind == "text":
            return self._wrap(self._stream.push_text(chunk.content, chunk.content_tokens))
        if chunk.kind == "token":
            if not self._has_tokenizer:
                raise RuntimeError("token chunk received without a tokenizer: pass one to StreamProcessor")
            return self._wrap(self._stream.push_token(chunk.token_id))
        if chunk.kind == "finish":
            return self._wrap(self._stream.finish(getattr(chunk.finish_reason, "value", chunk.finish_reason)))
        raise TypeError("not an InferenceChunk: %r" % (chunk,))

    def finish(self):
        return self._wrap(self._stream.finish("stop"))

    @property
    def finished(self):
        return self._stream.finished

    def close(self):
        """Nothing to release (kept for deepseek-recipe's API)."""


class _Response:
    """A whole (non-streamed) response, from the chunks of one StreamProcessor: append() each, then to_json().
    Response(id, model, created, ...): further positional numbers are accepted for deepseek-recipe's signature and
    unused (the usage comes from the stream)."""

    def __init__(self, id, model, created=0, *_unused):
        self.id = id
        self.model = model
        self.created = created
        self._stream = None

    def append(self, chunk):
        self._stream = chunk._stream

    def to_dict(self):
        if self._stream is None:
            raise ValueError("no chunks were appended")
        return self._stream.response(self.id, self.model, self.created)

    def to_json(self):
        return _core.json_text(self.to_dict())

    @staticmethod
    def chunk_event_type(chunk):
        """The SSE event name of a chunk (None: a data-only line)."""
        return chunk.event

    @staticmethod
    def done_message():
        """The stream's terminal data line after the last chunk, or None."""
        return None


class ChatCompletionResponse(_Response):
    @staticmethod
    def done_message():
        return "[DONE]"


class ResponsesResponse(_Response):
    pass


class MessagesResponse(_Response):
    pass
