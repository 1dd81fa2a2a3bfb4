"""deepseek_recipe: DeepSeek's exact prompt tokens and an incremental output parser, with a C++ core
(DeepInfer's recipe layer) instead of Jinja.

    import deepseek_recipe as ds_recipe

    conversation = ds_recipe.Conversation.from_openai(payload)        # or .from_anthropic(payload), or build it:
    # conversation = ds_recipe.Conversation(); conversation.add_user_message("Hi"); ...
    rendered = conversation.render_for_engine(tokenizer_model="deepseek-ai/DeepSeek-V4.1-Flash")
    rendered.token_ids    # list of int, JSON-ready (built on first access)
    rendered.token_array  # the same ids with no per-token Python objects: a read-only NumPy int32 array
                          # (a memoryview when NumPy is not installed), viewing the C++ vector
    parser = rendered.stream_parser()  # or ds_recipe.StreamOutputParser(tokenizer_model=...)
    for token_id in generated:
        ev = parser.step(token_id)
        if ev.is_reasoning(): ...ev.text()
        elif ev.is_content(): ...ev.text()
        if ev.is_tool_call_completed(): ev.get_tool_call().to_openai()

Token ids, two ways. `token_ids` is a plain list because that is what gateways hand on: JSON bodies
(json.dumps rejects arrays), vLLM's TokensPrompt, SGLang's input_ids. Building it costs one Python int per
token, once, on first access. `token_array` shares the C++ buffer instead (np.asarray / torch.frombuffer /
memoryview, zero-copy); it is read-only because the ids belong to the rendered prompt (.copy() for a writable
array).

`tokenizer_model` is a local directory holding tokenizer.json or a known model name (MODELS, tokenizer shipped
in this package); `format=` names the prompt format explicitly (FORMATS). Nothing is ever downloaded.
Errors from the C++ core raise ValueError (bad input: the message names the field, e.g.
"messages[2].tool_calls[0].function.arguments is not valid JSON ...") or RuntimeError.

Responses, as `deepinfer serve` sends them: ResponseStream("chat_completions" | "completions" | "messages" |
"responses", id=..., model=..., tokenizer_model=..., format=...) takes generated ids (push_token) or text
(push_text) and returns each dialect's stream chunks (StreamChunk: .to_json(), .to_sse()) and, after finish(),
the whole body (response()): the recipe's output parser, stop strings and response builders.

DeepSeek's deepseek-recipe API is here too, on the same core (_compat.py): ChatCompletionRequest(body).convert(
ConversionOptions()), ResponsesRequest, MessagesRequest, DeepseekV41Encoding().render_conversation(...).prompt,
.with_tokenizer(t).encode(...), StreamProcessor with InferenceChunk, and the response classes. Where it
deliberately differs from deepseek-recipe: docs/deepseek-recipe-parity.md.
"""
from . import _core
from ._core import (
    Conversation,
    ParsedMessage,
    RenderedInput,
    ResponseStream,
    StepEvent,
    StreamChunk,
    StreamEvent,
    StreamOutputParser,
    Tokenizer,
    ToolCall,
)
from ._models import FORMATS, MODELS, detect_format, format_for_model
from ._compat import (
    ASSISTANT_SP_TOKEN,
    BOS_TOKEN,
    DSML_SP_TOKEN,
    EOS_TOKEN,
    IMAGE_SPECIAL_TOKEN,
    IMAGE_SPECIAL_TOKEN_ID,
    LATEST_REMINDER_SP_TOKEN,
    SYSTEM_SP_TOKEN,
    THINKING_END_TOKEN,
    THINKING_START_TOKEN,
    USER_SP_TOKEN,
    AssistantMessage,
    ChatCompletionChunk,
    ChatCompletionChunkGenerator,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ConversationRequest,
    ConversionError,
    ConversionOptions,
    DeepseekV41Encoding,
    DeepseekV4Encoding,
    DeveloperMessage,
    InferenceChunk,
    InferenceFinishReason,
    InferenceOptions,
    LatestReminderMessage,
    Message,
    MessagesChunkGenerator,
    MessagesRequest,
    MessagesResponse,
    MessagesStreamEvent,
    ParsingOptions,
    PromptUsage,
    ReasoningStage,
    RenderedPrompt,
    ResponsesChunkGenerator,
    ResponsesRequest,
    ResponsesResponse,
    ResponsesStreamEvent,
    StreamProcessor,
    SystemMessage,
    ToolDefinition,
    ToolMessage,
    UserMessage,
    WebSearchBehavior,
)

# deepseek-recipe's image fetching and preprocessing (ImageResolver, OpenCV) are not part of this package.
HAS_IMAGE_BINDINGS = False

__version__ = "0.1.0"

__all__ = [
    "Conversation",
    "FORMATS",
    "MODELS",
    "ParsedMessage",
    "RenderedInput",
    "ResponseStream",
    "StepEvent",
    "StreamChunk",
    "StreamEvent",
    "StreamOutputParser",
    "Tokenizer",
    "ToolCall",
    "detect_format",
    "format_for_model",
    # deepseek-recipe's API (_compat.py)
    "ASSISTANT_SP_TOKEN",
    "BOS_TOKEN",
    "DSML_SP_TOKEN",
    "EOS_TOKEN",
    "HAS_IMAGE_BINDINGS",
    "IMAGE_SPECIAL_TOKEN",
    "IMAGE_SPECIAL_TOKEN_ID",
    "LATEST_REMINDER_SP_TOKEN",
    "SYSTEM_SP_TOKEN",
    "THINKING_END_TOKEN",
    "THINKING_START_TOKEN",
    "USER_SP_TOKEN",
    "AssistantMessage",
    "ChatCompletionChunk",
    "ChatCompletionChunkGenerator",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ConversationRequest",
    "ConversionError",
    "ConversionOptions",
    "DeepseekV41Encoding",
    "DeepseekV4Encoding",
    "DeveloperMessage",
    "InferenceChunk",
    "InferenceFinishReason",
    "InferenceOptions",
    "LatestReminderMessage",
    "Message",
    "MessagesChunkGenerator",
    "MessagesRequest",
    "MessagesResponse",
    "MessagesStreamEvent",
    "ParsingOptions",
    "PromptUsage",
    "ReasoningStage",
    "RenderedPrompt",
    "ResponsesChunkGenerator",
    "ResponsesRequest",
    "ResponsesResponse",
    "ResponsesStreamEvent",
    "StreamProcessor",
    "SystemMessage",
    "ToolDefinition",
    "ToolMessage",
    "UserMessage",
    "WebSearchBehavior",
]
