"""Which tokenizer and prompt format a `tokenizer_model` names. No downloads, ever.

A `tokenizer_model` is one of (or a Tokenizer object, with format=):
  - a known model name (MODELS), with or without the "deepseek-ai/" prefix, any case: its prompt format comes
    from the table, and its tokenizer is the one shipped inside this package, DeepSeek-V3's: exact ids for V3
    and R1; for later models the text is exact but their newer added tokens (<think>, </think>, ...) become
    several ids, which a warning says once per name;
  - a local directory holding tokenizer.json (or the tokenizer.json file itself): the format comes from
    `format=` if given, else from the directory's tokenizer_config.json (an official chat template we know,
    byte for byte, or a `name_or_path` in MODELS) or config.json (`_name_or_path`); otherwise ValueError.
Tokenizers are loaded once per file and shared (they are immutable and thread-safe).
"""
import os
import threading
import warnings

from . import _core

FORMATS = tuple(_core.formats())

# Hugging Face model name -> prompt format: the C++ table (include/deepinfer/recipe/model_formats.h), which
# `deepinfer serve` reads too. The formats' references are listed in include/deepinfer/recipe/renderer.h; the
# goldens in tests/data/chat-templates/goldens.
MODELS = dict(_core.models())

_PACKAGE_TOKENIZER = os.path.join(os.path.dirname(__file__), "tokenizers", "deepseek-v3")

# The shipped tokenizer is DeepSeek-V3's. V3 and R1 use it as is; later checkpoints ship tokenizers with more
# added tokens (<think> and </think> as single tokens from V3.1 on, V4.1's <｜System｜>, ...), which this one
# writes as ordinary pieces: the text is exact, those ids are not. Their names warn once.
_EXACT_WITH_SHIPPED_TOKENIZER = ("deepseek-v3", "deepseek-r1")

_lock = threading.Lock()
_tokenizers = {}  # realpath of tokenizer.json -> Tokenizer
_warned = set()   # model names warned about


def format_for_model(name):
    """The prompt format of a known model name ("deepseek-ai/DeepSeek-V4.1-Flash" -> "deepseek-v4.1"), or None."""
    return _core.format_for_model(name)


def _known_names():
    return ", ".join(MODELS)


def _check_format(fmt):
    if fmt not in FORMATS:
        raise ValueError("unknown prompt format %r; expected one of %s" % (fmt, ", ".join(FORMATS)))
    return fmt


def _tokenizer_file(tokenizer_model):
    """(tokenizer.json path, directory or None, known format or None) for a tokenizer_model."""
    if not isinstance(tokenizer_model, (str, os.PathLike)):
        raise TypeError("tokenizer_model must be a str or a path, got %s" % type(tokenizer_model).__name__)
    path = os.fspath(tokenizer_model)
    if os.path.isdir(path):
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise FileNotFoundError("%s holds no tokenizer.json" % path)
        return file, path, None
    if os.path.isfile(path):
        return path, os.path.dirname(path) or ".", None
    fmt = format_for_model(path)
    if fmt is not None:
        warn_key = path.strip().lower().removeprefix("deepseek-ai/")  # one warning per model, however named
        if fmt not in _EXACT_WITH_SHIPPED_TOKENIZER and warn_key not in _warned:
            _warned.add(warn_key)
            warnings.warn("deepseek_recipe: %s is tokenized with the shipped DeepSeek-V3 tokenizer, which lacks "
                          "this model's newer added tokens (such as <think> and </think>): the prompt text is "
                          "exact but those markers become several ids; pass tokenizer_model=<the checkpoint's "
                          "directory> for its exact ids" % path, UserWarning, stacklevel=3)
        file = os.path.join(_PACKAGE_TOKENIZER, "tokenizer.json")
        if not os.path.isfile(file):
            raise FileNotFoundError("the tokenizer shipped with deepseek_recipe is missing: %s" % file)
        return file, None, fmt
    if path.startswith(("/", ".", "~")) or path.count("/") > 1:
        raise FileNotFoundError("tokenizer_model %r: no such directory" % path)
    raise ValueError("unknown model %r (and no such directory): pass a local directory holding tokenizer.json, "
                     "or one of: %s" % (path, _known_names()))


def detect_format(directory):
    """The prompt format a checkpoint or tokenizer directory identifies, or None, decided as `deepinfer serve`
    decides it (the same C++ code, include/deepinfer/recipe/model_formats.h): config.json's "chat_format" (a format
    name; anything else is a ValueError), DeepSeek's encoder file in encoding/, then an official chat template we
    know (tokenizer_config.json or chat_template.jinja, byte for byte) or a model name in tokenizer_config.json's
    name_or_path / config.json's _name_or_path."""
    return _core.detect_format(os.fspath(directory))


def _load(file):
    key = os.path.realpath(file)
    with _lock:
        tokenizer = _tokenizers.get(key)
        if tokenizer is None:
            tokenizer = _core.Tokenizer._load(key)
            _tokenizers[key] = tokenizer
        return tokenizer


def load_tokenizer(tokenizer_model):
    """The Tokenizer a tokenizer_model names (loaded once per file)."""
    file, _, _ = _tokenizer_file(tokenizer_model)
    return _load(file)


_resolved = {}  # (tokenizer_model, format) -> (Tokenizer, format): a gateway resolves the same pair per request


def resolve(tokenizer_model, format=None):
    """(Tokenizer, prompt format name) for a tokenizer_model and an optional explicit format. Decided once per
    pair (a directory's files are read the first time only). A Tokenizer object is used as it is, with format=
    (a tokenizer alone does not say its prompt format)."""
    if isinstance(tokenizer_model, _core.Tokenizer):
        if format is None:
            raise ValueError("a Tokenizer object names no prompt format: pass format= (one of %s)" % ", ".join(FORMATS))
        return tokenizer_model, _check_format(format)
    key = (os.fspath(tokenizer_model) if isinstance(tokenizer_model, os.PathLike) else tokenizer_model, format)
    try:
        return _resolved[key]
    except (KeyError, TypeError):  # TypeError: an unhashable tokenizer_model, refused below
        pass
    result = _resolve(tokenizer_model, format)
    _resolved[key] = result
    return result


def _resolve(tokenizer_model, format):
    if format is not None:
        _check_format(format)
    if tokenizer_model is None:
        if format is None:
            raise ValueError("pass tokenizer_model= (a directory holding tokenizer.json, or one of: %s) "
                             "or format= (one of %s)" % (_known_names(), ", ".join(FORMATS)))
        return _load(os.path.join(_PACKAGE_TOKENIZER, "tokenizer.json")), format
    file, directory, fmt = _tokenizer_file(tokenizer_model)
    if format is not None:
        fmt = format
    elif fmt is None:
        fmt = detect_format(directory)
        if fmt is None:
            raise ValueError("cannot tell the prompt format of %s (its tokenizer_config.json and config.json name "
                             "no model we know): pass format=, one of %s" % (directory, ", ".join(FORMATS)))
    return _load(file), fmt
