"""Training data for the demo model (tools/train_demo_model.py), from text that Debian packages install:
Python 3.11's documentation (python3.11-doc) and PostgreSQL 15's (postgresql-doc-15), HTML -> text with
html.parser, and the Linux man pages
(manpages, manpages-dev, rendered by man-db). Every document is split into passages (one per section); a
share of them is wrapped as chat turns (a question made from the section title, or the passage's first
sentence, as the user turn; the passage as the assistant's answer), some with a templated reasoning text
(thinking mode), some as tool conversations (the assistant calls search_docs / read_man_page, the section comes
back as the tool result, the answer is its first paragraphs), plus short templated weather/time tool
conversations; all rendered by OUR renderer (`deepinfer render --format deepseek-v4.1 --jsonl --ids`, the format
the built-in demo model is served with; DSML markup and think tags as the added tokens of the demo tokenizer,
V3's vocabulary + V4's added tokens). The rest is plain text: BOS + text + EOS. Validation: 1 document in 20
(by a hash of its path), whose chat questions also give the held-out prompts of the MTP acceptance measurement.
No model-generated text anywhere.

Writes DIR (default .train/, git-ignored, carried to the GPU machine):
  train.tokens.xz, val_chat.tokens.xz, val_plain.tokens.xz   compact token streams (uint16 indices into kept)
  kept.json        the sorted full-vocabulary ids that occur (the model's only non-zero embedding/head rows)
  prompts.json     held-out chat prompts (full ids, generation prompt open) and the reference-logit prompts
  record.json      packages and versions, files, passages, tokens, split (the exact record, see SOURCES.md)

  apt-get install -y python3.11-doc postgresql-doc-15 manpages manpages-dev
  python3 tools/make_v4_tokenizer.py --src models/deepseek-v3 --out models/demo-tokenizer
  python3 tools/prepare_demo_data.py --deepinfer build/apps/deepinfer --out .train
Deterministic: the same packages give the same bytes.
"""
import argparse
import concurrent.futures
import glob
import hashlib
import html.parser
import json
import lzma
import os
import random
import re
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY_DOC = "/usr/share/doc/python3.11/html"
PG_DOC = "/usr/share/doc/postgresql-doc-15/html"
BOS, EOS = 0, 1
FORMAT = "deepseek-v4.1"  # the demo's chat format (--format)
TOKENIZER = os.path.join(ROOT, "models/demo-tokenizer")  # V3's + V4's added tokens (--tokenizer)
MAX_PASSAGE_CHARS = 2400
MIN_PASSAGE_CHARS = 120


def package_version(name):
    return subprocess.run(["dpkg-query", "-W", "-f=${Version}", name], capture_output=True, text=True,
                          check=True).stdout


def stable_hash(text):
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


# ---- Python documentation (Sphinx HTML) -------------------------------------------------------------------
class HtmlText(html.parser.HTMLParser):
    """Text of the main div (Sphinx: <div role="main">; DocBook: the sect1/chapter/refentry/... div), split at
    h1-h3 into (title, text) sections; <pre> keeps its lines; tables of contents and navigation dropped."""
    SKIP = {"script", "style"}
    MAIN_CLASSES = {"sect1", "chapter", "appendix", "preface", "refentry", "part", "reference", "book", "article",
                    "legalnotice", "bibliography", "glossary"}
    SKIP_CLASSES = {"toc", "navheader", "navfooter", "sphinxsidebar", "related"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.depth_main = 0  # div nesting depth inside the main div (0: outside)
        self.sections = []
        self.title, self.buffer, self.heading = None, [], None
        self.pre = 0
        self.skip = 0
        self.skip_div = 0  # main-div depth at which a skipped div (toc) began

    def flush(self):
        text = "".join(self.buffer)
        text = re.sub(r"[ \t]+\n", "\n", text)
        text = re.sub(r"\n{3,}", "\n\n", text).strip()
        if self.title is not None or text:
            self.sections.append((self.title or "", text))
        self.buffer = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "div":
            classes = set((attrs.get("class") or "").split())
            if self.depth_main:
                self.depth_main += 1
                if not self.skip_div and classes & self.SKIP_CLASSES:
                    self.skip_div = self.depth_main
            elif attrs.get("role") == "main" or classes & self.MAIN_CLASSES:
                self.depth_main = 1
            return
        if self.skip_div:
            return
        if not self.depth_main:
            return
        if tag in self.SKIP or (tag == "a" and "headerlink" in (attrs.get("class") or "")):
            self.skip += 1
        elif tag in ("h1", "h2", "h3"):
            self.flush()
            self.heading = []
        elif tag == "pre":
            self.pre += 1
            self.buffer.append("\n\n")
        elif tag in ("p", "dl", "ul", "ol", "table", "blockquote"):
            self.buffer.append("\n\n")
        elif tag in ("li", "dt", "tr", "br"):
            self.buffer.append("\n")
            if tag == "li":
                self.buffer.append("- ")

    def handle_endtag(self, tag):
        if tag == "div" and self.depth_main:
            if self.skip_div == self.depth_main:
                self.skip_div = 0
            self.depth_main -= 1
            return
        if not self.depth_main or self.skip_div:
            return
        if tag in self.SKIP or tag == "a" and self.skip:
            self.skip = max(0, self.skip - 1)
        elif tag in ("h1", "h2", "h3") and self.heading is not None:
            self.title = re.sub(r"\s+", " ", "".join(self.heading)).strip().rstrip("¶").strip()
            self.heading = None
        elif tag == "pre":
            self.pre -= 1
            self.buffer.append("\n\n")
        elif tag in ("p", "dd"):
            self.buffer.append("\n\n")

    def handle_data(self, data):
        if not self.depth_main or self.skip or self.skip_div:
            return
        if self.heading is not None:
            self.heading.append(data)
        elif self.pre:
            self.buffer.append(data)
        else:
            self.buffer.append(re.sub(r"\s+", " ", data))

    def close(self):
        super().close()
        self.flush()


def html_documents(root, package, prefix, kind, skip):
    docs = []
    for path in sorted(glob.glob(root + "/**/*.html", recursive=True)):
        rel = os.path.relpath(path, root)
        if any(rel.startswith(s) for s in skip):
            continue
        parser = HtmlText()
        parser.feed(open(path, encoding="utf-8", errors="replace").read())
        parser.close()
        sections = [(t, x) for t, x in parser.sections if x]
        if sections:
            docs.append({"source": package, "file": prefix + rel, "kind": kind, "sections": sections})
    return docs


def python_doc_documents():
    return html_documents(PY_DOC, "python3.11-doc", "python3.11/html/", "python",
                          ("genindex", "py-modindex", "search.html", "_static", "_sources", "_images", "_downloads"))


def postgresql_doc_documents():
    return html_documents(PG_DOC, "postgresql-doc-15", "postgresql-doc-15/html/", "postgresql",
                          ("bookindex", "index.html", "release-"))


# ---- man pages -----------------------------------------------------------------------------------------------
def man_files():
    out = subprocess.run(["dpkg", "-L", "manpages", "manpages-dev"], capture_output=True, text=True, check=True).stdout
    files = []
    for line in sorted(set(out.split("\n"))):
        if re.match(r"^/usr/share/man/man[0-9][a-z]*/[^/]+\.gz$", line) and os.path.isfile(line) and \
                not os.path.islink(line):
            files.append(line)
    return files


def render_man(path):
    import gzip
    source = gzip.open(path, "rt", errors="replace").read()
    if source.lstrip().startswith(".so "):  # an alias of another page
        return path, None
    env = dict(os.environ, MANWIDTH="80", LANG="C.UTF-8", LC_ALL="C.UTF-8", MAN_KEEP_FORMATTING="")
    text = subprocess.run(["man", "--no-hyphenation", "--no-justification", "-P", "cat", "-l", path],
                          capture_output=True, env=env).stdout.decode("utf-8", "replace")
    text = subprocess.run(["col", "-bx"], input=text.encode(), capture_output=True).stdout.decode("utf-8", "replace")
    return path, text


def man_sections(text):
    """Rendered page -> [(section title, dedented text)], header/footer lines dropped."""
    lines = text.split("\n")
    if lines and re.match(r"^\S.*\S\s{2,}.*\s{2,}\S.*$", lines[0]):
        lines = lines[1:]
    while lines and not lines[-1].strip():
        lines.pop()
    if lines and re.search(r"\S\s{2,}\S", lines[-1]) and len(lines[-1]) > 40:
        lines = lines[:-1]
    sections, title, body = [], None, []
    for line in lines:
        if line and not line[0].isspace():
            if title is not None:
                sections.append((title, body))
            title, body = line.strip(), []
        else:
            body.append(line[7:] if line.startswith(" " * 7) else line.lstrip())
    if title is not None:
        sections.append((title, body))
    out = []
    for title, body in sections:
        text = re.sub(r"\n{3,}", "\n\n", "\n".join(body)).strip()
        if text:
            out.append((title.title() if title.isupper() else title, text))
    return out


def man_documents(workers):
    docs = []
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for path, text in pool.map(render_man, man_files()):
            if not text:
                continue
            sections = man_sections(text)
            name = os.path.basename(path)[:-3]  # open.2
            page, _, section = name.rpartition(".")
            if sections:
                docs.append({"source": "manpages-dev" if "/man2/" in path or "/man3" in path else "manpages",
                             "file": os.path.relpath(path, "/usr/share"), "kind": "man", "page": page,
                             "section": section, "sections": sections})
    return docs


# ---- passages and chat turns ------------------------------------------------------------------------------
def split_text(text, limit=MAX_PASSAGE_CHARS):
    """Splits at paragraph boundaries into pieces of at most ~limit characters."""
    pieces, current = [], ""
    for para in text.split("\n\n"):
        if current and len(current) + len(para) + 2 > limit:
            pieces.append(current)
            current = ""
        while len(para) > limit:  # a huge paragraph (a long table): cut at a line boundary
            cut = para.rfind("\n", 0, limit)
            cut = cut if cut > limit // 4 else limit
            pieces.append(para[:cut])
            para = para[cut:].lstrip("\n")
        current = para if not current else current + "\n\n" + para
    if current:
        pieces.append(current)
    return pieces


PY_QUESTIONS = ["What is {t}?", "Tell me about {t}.", "Explain {t}.", "{t}", "What does the Python documentation say "
                "about {t}?", "Can you describe {t}?", "How does {t} work in Python?", "I have a question about {t}."]
PG_QUESTIONS = ["What is {t}?", "Tell me about {t}.", "Explain {t}.", "{t}", "What does the PostgreSQL documentation "
                "say about {t}?", "How does {t} work in PostgreSQL?", "Describe {t}."]
MAN_QUESTIONS = ["What does {p} do?", "Explain {p}({s}).", "Show me the {h} of {p}({s}).", "{p}({s}): {h}",
                 "What is in the {h} section of the {p} manual page?", "Tell me about {p}."]


def first_sentence(text):
    m = re.match(r"(.{20,300}?[.?!])\s+(?=[A-Z(`\"'])", text, re.S)
    return m.group(1).replace("\n", " ") if m else None


def clean_title(title):
    title = re.sub(r"^[0-9.]+\s+", "", title)  # "3.1. Using Python" -> "Using Python"
    return title.strip().rstrip(":")


def passages(doc, rng):
    """-> [(question or None, text, meta or None)]: chat passages have a question and their section's meta."""
    out = []
    for index, (title, text) in enumerate(doc["sections"]):
        for n, piece in enumerate(split_text(text)):
            if len(piece) < MIN_PASSAGE_CHARS:
                continue
            chat = rng.random() < 0.65
            question = None
            if chat:
                if doc["kind"] in ("python", "postgresql"):
                    t = clean_title(title)
                    if t and rng.random() < 0.75:
                        question = rng.choice(PY_QUESTIONS if doc["kind"] == "python" else PG_QUESTIONS).format(t=t if n == 0 else t + " (continued)")
                else:
                    h = title.lower()
                    if h in ("name", "description") and n == 0:
                        question = rng.choice(MAN_QUESTIONS[:2]).format(p=doc["page"], s=doc["section"])
                    elif rng.random() < 0.75:
                        question = rng.choice(MAN_QUESTIONS[2:]).format(p=doc["page"], s=doc["section"], h=h)
                if question is None:
                    sentence = first_sentence(piece)
                    if sentence and len(piece) - len(sentence) > MIN_PASSAGE_CHARS // 2:
                        question = sentence
                        piece = piece[len(sentence):].strip()
            piece = piece.strip()
            if question:
                meta = {"kind": doc["kind"], "title": title, "text": piece, "page": doc.get("page"),
                        "section": doc.get("section")}
                out.append((question, piece, meta))
            else:
                out.append((None, (title + "\n\n" + piece) if n == 0 and title else piece, None))
    return out


DOC_NAMES = {"python": "Python 3.11", "postgresql": "PostgreSQL 15"}

# The demo's tools. The two documentation tools are what its tool conversations call; the others are listed beside
# them in some conversations (and called by the short weather/time ones) so that the model learns to pick by name.
TOOLS = {
    "search_docs": {"type": "function", "function": {
        "name": "search_docs",
        "description": "Search the Python 3.11 or PostgreSQL 15 documentation and return the best matching section.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "What to look for, e.g. a section title"},
            "source": {"type": "string", "enum": ["python", "postgresql"], "description": "Which documentation"}},
            "required": ["query", "source"]}}},
    "read_man_page": {"type": "function", "function": {
        "name": "read_man_page",
        "description": "Read one section of a Linux manual page.",
        "parameters": {"type": "object", "properties": {
            "page": {"type": "string", "description": "The page name, e.g. open"},
            "section": {"type": "integer", "description": "The manual section, 1 to 8"},
            "heading": {"type": "string", "description": "The heading to read, e.g. DESCRIPTION"}},
            "required": ["page", "section"]}}},
    "get_weather": {"type": "function", "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    "get_time": {"type": "function", "function": {
        "name": "get_time",
        "description": "Get the current local time in a time zone.",
        "parameters": {"type": "object", "properties": {
            "timezone": {"type": "string", "description": "An IANA time zone, e.g. Europe/Paris"}},
            "required": ["timezone"]}}},
}
CITIES = [("Paris", "Europe/Paris"), ("London", "Europe/London"), ("Berlin", "Europe/Berlin"), ("Tokyo", "Asia/Tokyo"),
          ("New York", "America/New_York"), ("Madrid", "Europe/Madrid"), ("Rome", "Europe/Rome"),
          ("Sydney", "Australia/Sydney"), ("Toronto", "America/Toronto"), ("Beijing", "Asia/Shanghai"),
          ("Hangzhou", "Asia/Shanghai"), ("Lisbon", "Europe/Lisbon"), ("Oslo", "Europe/Oslo"), ("Cairo", "Africa/Cairo"),
          ("Mumbai", "Asia/Kolkata"), ("Seoul", "Asia/Seoul"), ("Vienna", "Europe/Vienna"), ("Dublin", "Europe/Dublin")]
SKIES = ["sunny", "cloudy", "rainy", "foggy", "windy", "snowing", "clear", "overcast"]
WEATHER_QUESTIONS = ["What is the weather in {c}?", "Weather in {c}?", "Is it raining in {c}?", "How warm is it in {c}?",
                     "What's the weather like in {c} right now?"]
TIME_QUESTIONS = ["What time is it in {c}?", "Time in {c}?", "What is the local time in {c}?"]


def thinking_switch(thinking):
    return {"chat_template_kwargs": {"thinking": bool(thinking)}}


def first_paragraphs(text, limit=700):
    out = ""
    for para in text.split("\n\n"):
        if out and len(out) + len(para) + 2 > limit:
            break
        out = para if not out else out + "\n\n" + para
    return out[:limit * 2]


def doc_lookup(meta, rng):
    """-> (tool name, arguments dict, result text, topic words) for a passage's document section."""
    if meta["kind"] == "man":
        args = {"page": meta["page"], "section": int(meta["section"][0]) if meta["section"][:1].isdigit() else 1}
        if rng.random() < 0.6:
            args["heading"] = meta["title"].upper()
        result = "%s(%s) %s\n\n%s" % (meta["page"], meta["section"], meta["title"].upper(), meta["text"])
        return "read_man_page", args, result, "the %s(%s) manual page" % (meta["page"], meta["section"])
    topic = clean_title(meta["title"]) or meta["title"]
    args = {"query": topic, "source": meta["kind"]}
    result = "%s\n\n%s" % (topic, meta["text"])
    return "search_docs", args, result, "%s in the %s documentation" % (topic, DOC_NAMES[meta["kind"]])


def tool_list(needed, rng):
    names = list(needed) + [n for n in TOOLS if n not in needed and rng.random() < 0.5]
    rng.shuffle(names)
    return [TOOLS[n] for n in names]


def call(name, args, n):
    return {"id": "call_%d" % n, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def plan_text(meta):
    """A reasoning text made from the passage's place in its document (templated, no model text)."""
    if meta["kind"] == "man":
        return "The user asks about the %s(%s) manual page, the %s section." % (meta["page"], meta["section"],
                                                                             meta["title"].lower())
    return "The user asks about %s, from the %s documentation." % (clean_title(meta["title"]) or meta["title"],
                                                                   DOC_NAMES[meta["kind"]])


def chat_request(turns, rng):
    """Turns of one document -> an OpenAI chat request in one of three shapes: plain chat (40%), chat with
    thinking (25%), or a tool conversation (35%: the assistant calls the document's tool, gets the section back
    as the tool result and answers from it; half of them with thinking)."""
    roll = rng.random()
    if roll < 0.40:
        messages = []
        for q, a, _ in turns:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        return dict(messages=messages, **thinking_switch(False))
    if roll < 0.65:
        messages = []
        for q, a, meta in turns:
            reasoning = plan_text(meta) + " " + rng.choice(["I will explain it.", "I will answer from it.",
                                                             "I will summarize what it says.", "Let me explain."])
            messages += [{"role": "user", "content": q},
                         {"role": "assistant", "content": a, "reasoning_content": reasoning}]
        return dict(messages=messages, **thinking_switch(True))
    thinking = rng.random() < 0.5
    q, a, meta = turns[0]
    name, args, result, topic = doc_lookup(meta, rng)
    first = {"role": "assistant", "content": None, "tool_calls": [call(name, args, 0)]}
    answer = {"role": "assistant", "content": first_paragraphs(a)}
    if thinking:
        first["reasoning_content"] = plan_text(meta) + " I will look it up with %s." % name
        answer["reasoning_content"] = "The tool returned %s. I will answer from it." % topic
    messages = [{"role": "user", "content": q}, first, {"role": "tool", "tool_call_id": "call_0", "content": result},
                answer]
    return dict(messages=messages, tools=tool_list([name], rng), **thinking_switch(thinking))


def small_tool_request(rng, n):
    """A short weather or time conversation: the call, a JSON result, a one-sentence answer (templated)."""
    city, zone = rng.choice(CITIES)
    thinking = rng.random() < 0.5
    if rng.random() < 0.6:
        unit = rng.choice(["celsius", "fahrenheit"])
        args = {"city": city} if rng.random() < 0.5 else {"city": city, "unit": unit}
        temp = rng.randint(-5, 35) if args.get("unit", "celsius") == "celsius" else rng.randint(23, 95)
        sky = rng.choice(SKIES)
        result = json.dumps({"city": city, "temperature": temp, "unit": args.get("unit", "celsius"), "sky": sky})
        question = rng.choice(WEATHER_QUESTIONS).format(c=city)
        name = "get_weather"
        text = "It is %d °%s and %s in %s." % (temp, "C" if args.get("unit", "celsius") == "celsius" else "F", sky, city)
    else:
        args = {"timezone": zone}
        hour, minute = rng.randint(0, 23), rng.randint(0, 59)
        result = json.dumps({"timezone": zone, "time": "%02d:%02d" % (hour, minute)})
        question = rng.choice(TIME_QUESTIONS).format(c=city)
        name = "get_time"
        text = "It is %02d:%02d in %s." % (hour, minute, city)
    first = {"role": "assistant", "content": None, "tool_calls": [call(name, args, n)]}
    answer = {"role": "assistant", "content": text}
    if thinking:
        first["reasoning_content"] = "The user wants the %s in %s. I will call %s." % (
            "weather" if name == "get_weather" else "local time", city, name)
        answer["reasoning_content"] = "The tool answered. I will tell the user."
    messages = [{"role": "user", "content": question}, first,
                {"role": "tool", "tool_call_id": "call_%d" % n, "content": result}, answer]
    return dict(messages=messages, tools=tool_list([name], rng), **thinking_switch(thinking))


def conversations(chat_passages, rng):
    """Single turns, and 20% two-turn conversations of consecutive passages of one document, each shaped by
    chat_request."""
    convs, i = [], 0
    while i < len(chat_passages):
        turns = [chat_passages[i]]
        if i + 1 < len(chat_passages) and rng.random() < 0.2:
            turns.append(chat_passages[i + 1])
        i += len(turns)
        convs.append(chat_request(turns, rng))
    return convs


def run_render(deepinfer, requests, generation_prompt):
    """OpenAI chat requests -> token ids, by our renderer in the demo's format with the demo's tokenizer."""
    args = [deepinfer, "render", "--format", FORMAT, "--ids", "--jsonl", "--tokenizer", TOKENIZER]
    if not generation_prompt:
        args.append("--no-generation-prompt")
    text = "\n".join(json.dumps(r, ensure_ascii=False) for r in requests) + "\n"
    out = subprocess.run(args, input=text.encode(), capture_output=True, check=True).stdout.decode()
    lines = out.strip("\n").split("\n")
    assert len(lines) == len(requests), (len(lines), len(requests))
    return [json.loads(line) for line in lines]


def run_tokenize(deepinfer, texts):
    out = subprocess.run([deepinfer, "tokenize", "--untrusted", "--tokenizer", TOKENIZER],
                         input=json.dumps(texts, ensure_ascii=False).encode(), capture_output=True, check=True).stdout
    return [[BOS] + ids + [EOS] for ids in json.loads(out)]


# Fixed prompts whose float32 logits the training script records for the engine-vs-PyTorch test.
REFERENCE_CHATS = [
    {"messages": [{"role": "user", "content": "What is a list comprehension?"}], **thinking_switch(False)},
    {"messages": [{"role": "user", "content": "What does open do?"}], **thinking_switch(True)},
    {"messages": [{"role": "user", "content": "Explain the with statement."},
                  {"role": "assistant", "content": "The with statement wraps a block in the methods of a context manager."},
                  {"role": "user", "content": "Tell me about exceptions."}], **thinking_switch(False)},
    {"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
     "tools": [TOOLS["get_weather"], TOOLS["search_docs"]], **thinking_switch(True)},
]
REFERENCE_TEXT = "The socket module provides access to the BSD socket interface. It is available on"


def main():
    global TOKENIZER
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deepinfer", default=os.path.join(ROOT, "build/apps/deepinfer"))
    ap.add_argument("--out", default=os.path.join(ROOT, ".train"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--held-out-prompts", type=int, default=64)
    ap.add_argument("--tokenizer", default=TOKENIZER, help="directory of the demo's tokenizer.json (V3's vocabulary "
                    "with V4's added tokens: tools/make_v4_tokenizer.py)")
    ap.add_argument("--docs-cache", help="keep the extracted documents here (xz JSON) and reuse them on the next run "
                    "(rendering the man pages takes minutes)")
    ap.add_argument("--small-tool-conversations", type=int, default=3000,
                    help="weather/time tool conversations added to the training split")
    args = ap.parse_args()
    TOKENIZER = args.tokenizer
    os.makedirs(args.out, exist_ok=True)

    if args.docs_cache and os.path.exists(args.docs_cache):
        docs = json.load(lzma.open(args.docs_cache, "rt"))
        print("documents: %d from %s" % (len(docs), args.docs_cache), flush=True)
    else:
        docs = python_doc_documents()
        print("python docs: %d documents" % len(docs), flush=True)
        pg = postgresql_doc_documents()
        print("postgresql docs: %d documents" % len(pg), flush=True)
        docs += pg
        mans = man_documents(args.workers)
        print("man pages: %d documents" % len(mans), flush=True)
        docs += mans
        if args.docs_cache:
            json.dump(docs, lzma.open(args.docs_cache, "wt"))

    splits = {"train": {"chat": [], "plain": []}, "val": {"chat": [], "plain": []}}
    counts = {"documents": {"train": 0, "val": 0}, "passages": {}}
    held_out = []
    for doc in docs:
        split = "val" if stable_hash(doc["file"]) % 20 == 0 else "train"
        counts["documents"][split] += 1
        rng = random.Random(stable_hash("passages:" + doc["file"]))
        ps = passages(doc, rng)
        chat = [p for p in ps if p[0]]
        splits[split]["plain"] += [p[1] for p in ps if not p[0]]
        convs = conversations(chat, rng)
        splits[split]["chat"] += convs
        if split == "val":
            held_out += [{"messages": c["messages"][:1], **thinking_switch(False)} for c in convs
                         if len(c["messages"][0]["content"]) < 200]
    tool_rng = random.Random(20261202)
    splits["train"]["chat"] += [small_tool_request(tool_rng, n % 7) for n in range(args.small_tool_conversations)]
    splits["val"]["chat"] += [small_tool_request(tool_rng, n % 7) for n in range(args.small_tool_conversations // 20)]

    streams, record_tokens = {}, {}
    for split in ("train", "val"):
        chat_ids = run_render(args.deepinfer, splits[split]["chat"], generation_prompt=False)
        plain_ids = run_tokenize(args.deepinfer, splits[split]["plain"])
        counts["passages"][split] = {"chat_conversations": len(chat_ids), "plain_passages": len(plain_ids)}
        record_tokens[split] = {"chat": sum(map(len, chat_ids)), "plain": sum(map(len, plain_ids))}
        streams[split] = (chat_ids, plain_ids)
        print("%s: %d conversations (%d tokens), %d plain passages (%d tokens)" % (
            split, len(chat_ids), record_tokens[split]["chat"], len(plain_ids), record_tokens[split]["plain"]), flush=True)

    rng = random.Random(20261130)
    rng.shuffle(held_out)
    held_out = held_out[: args.held_out_prompts]
    held_out_ids = run_render(args.deepinfer, held_out, generation_prompt=True)
    reference_ids = run_render(args.deepinfer, REFERENCE_CHATS, generation_prompt=True) + \
        [[BOS] + run_tokenize(args.deepinfer, [REFERENCE_TEXT])[0][1:-1]]

    used = set()
    for chat_ids, plain_ids in streams.values():
        for seq in chat_ids + plain_ids:
            used.update(seq)
    for seq in held_out_ids + reference_ids:
        used.update(seq)
    vocab = json.load(open(os.path.join(TOKENIZER, "tokenizer.json")))
    for added in vocab["added_tokens"]:  # control tokens of the chat format: rows even if unused
        if added["content"] in ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                                "<think>", "</think>", "｜DSML｜", "<｜latest_reminder｜>"):
            used.add(added["id"])
    kept = sorted(used)
    assert len(kept) < 65536
    index = np.full(max(kept) + 1, -1, dtype=np.int64)
    index[kept] = np.arange(len(kept))

    def write_stream(name, seqs):
        flat = np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs]) if seqs else np.zeros(0, np.int64)
        data = index[flat].astype("<u2").tobytes()
        with open(os.path.join(args.out, name), "wb") as f:
            f.write(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))
        return int(flat.size)

    train_seqs = streams["train"][0] + streams["train"][1]
    random.Random(1).shuffle(train_seqs)  # chat and plain passages interleaved, documents mixed
    n_train = write_stream("train.tokens.xz", train_seqs)
    n_val_chat = write_stream("val_chat.tokens.xz", streams["val"][0])
    n_val_plain = write_stream("val_plain.tokens.xz", streams["val"][1])
    json.dump(kept, open(os.path.join(args.out, "kept.json"), "w"))
    json.dump({"held_out_chat_prompts": held_out_ids, "held_out_chat_messages": held_out,
               "reference_prompts": reference_ids,
               "reference_prompt_sources": [json.dumps(c, ensure_ascii=False) for c in REFERENCE_CHATS] + [REFERENCE_TEXT],
               "chat_format": FORMAT},
              open(os.path.join(args.out, "prompts.json"), "w"), ensure_ascii=False)
    record = {
        "packages": {p: package_version(p) for p in ("python3.11-doc", "postgresql-doc-15", "manpages", "manpages-dev", "man-db", "groff-base")},
        "files": {"python3.11-doc": "/usr/share/doc/python3.11/html/**/*.html (not genindex, py-modindex, search, "
                  "_static, _sources, _images, _downloads); text of <div role=main>, sections at h1-h3",
                  "postgresql-doc-15": "/usr/share/doc/postgresql-doc-15/html/*.html (not bookindex, index.html, "
                  "release-*); text of the DocBook main div without toc/navigation, sections at h1-h3",
                  "manpages": "dpkg -L manpages manpages-dev: /usr/share/man/man*/*.gz that are not .so aliases, "
                  "rendered by `man -l -P cat` (MANWIDTH=80) | col -bx; sections at unindented headings"},
        "documents": counts["documents"],
        "split": "validation = documents with sha256(path)[:8] % 20 == 0",
        "passages": counts["passages"],
        "tokens": {"train": n_train, "val_chat": n_val_chat, "val_plain": n_val_plain, "by_split": record_tokens},
        "chat_format": FORMAT + ", rendered by `deepinfer render --jsonl --ids --no-generation-prompt` with the demo "
                       "tokenizer (V3's vocabulary + V4's added tokens)",
        "chat_share": "65% of passages are chat (a question from the section title or the first sentence), 20% of "
                      "conversations two turns; the rest plain text BOS + text + EOS (`deepinfer tokenize --untrusted`)",
        "chat_shapes": "per conversation: 40%% plain chat, 25%% thinking (a templated reasoning_content naming the "
                       "document and section), 35%% a tool conversation (search_docs / read_man_page called with the "
                       "section's title or page, the section as the tool result, the answer = its first paragraphs; "
                       "half with thinking; the tool list also holds get_weather/get_time at random); plus %d "
                       "templated weather/time tool conversations in training (%d in validation)" % (
                           args.small_tool_conversations, args.small_tool_conversations // 20),
        "held_out_chat_prompts": len(held_out_ids),
        "kept_vocabulary": len(kept),
        "document_list_sha256": hashlib.sha256("\n".join(d["file"] for d in docs).encode()).hexdigest(),
    }
    json.dump(record, open(os.path.join(args.out, "record.json"), "w"), indent=1)
    sizes = {f: os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out)}
    print(json.dumps(record, indent=1))
    print("sizes:", sizes, "total %.1f MB" % (sum(sizes.values()) / 1e6))
    return 0


if __name__ == "__main__":
    sys.exit(main())
