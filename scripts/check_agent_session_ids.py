"""Reference check, run on the GPU machine (it has transformers and tokenizers): our token ids for the 88K-token
agent session (deepinfer render --format deepseek-v3 --ids) against the reference pipeline: transformers'
apply_chat_template (official DeepSeek-V3 template) to text, then Hugging Face `tokenizers` on tokenizer.json.
Also reports what apply_chat_template(tokenize=True) returns: transformers 5 loads DeepSeek's tokenizer as
LlamaTokenizerFast with a Metaspace pre-tokenizer and gets different ids (transformers#45488).
Usage: python3 check_agent_session_ids.py TOKENIZER_DIR REQUEST.json OURS.json"""
import json
import sys

from tokenizers import Tokenizer
from transformers import AutoTokenizer

tokenizer_dir, request_path, ours_path = sys.argv[1:4]
request = json.load(open(request_path, encoding="utf-8"))
auto = AutoTokenizer.from_pretrained(tokenizer_dir)
text = auto.apply_chat_template(request["messages"], tools=request.get("tools"), tokenize=False,
                                add_generation_prompt=True)
reference = Tokenizer.from_file(tokenizer_dir + "/tokenizer.json").encode(text, add_special_tokens=False).ids
via_transformers = auto.apply_chat_template(request["messages"], tools=request.get("tools"), tokenize=True,
                                            add_generation_prompt=True)
if hasattr(via_transformers, "keys"):
    via_transformers = via_transformers["input_ids"]
ours = json.load(open(ours_path))
first_diff = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), None)
print(json.dumps({"check": "agent_session_ids", "tokens_ours": len(ours), "tokens_reference": len(reference),
                  "identical": ours == reference, "first_difference": first_diff,
                  "apply_chat_template_tokenize_true_tokens": len(via_transformers),
                  "apply_chat_template_tokenize_true_identical": list(via_transformers) == reference}))
