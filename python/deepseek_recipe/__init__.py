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
"""
from . import _core
from ._core import (
    Conversation,
    ParsedMessage,
    RenderedInput,
    StepEvent,
    StreamEvent,
    StreamOutputParser,
    Tokenizer,
    ToolCall,
)
from ._models import FORMATS, MODELS, detect_format, format_for_model

__version__ = "0.1.0"

__all__ = [
    "Conversation",
    "FORMATS",
    "MODELS",
    "ParsedMessage",
    "RenderedInput",
    "StepEvent",
    "StreamEvent",
    "StreamOutputParser",
    "Tokenizer",
    "ToolCall",
    "detect_format",
    "format_for_model",
]
