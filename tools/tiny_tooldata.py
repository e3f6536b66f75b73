"""Chat data for fine-tuning the bundled model on tools and JSON (tools/tiny_finetune.py ft-data).

Conversations in OpenAI's message shape, rendered by the daemon's own chat template
(daemon/engine/model/chat_templates.py, Qwen3.5's tool format) through the bundled tokenizer,
exactly as the daemon renders a request. Kinds of sample:

  call      tools in the system turn (1-5 of them), a user asking for an action -> one call
            (sometimes two) of the right tool, arguments copied from the request
  result    the same, then the tool's result as a ``<tool_response>`` turn and a short answer
            (sometimes a second request and call after it)
  chat      tools present, chit-chat -> text, no call
  json      a schema (in the system turn, or only "answer in JSON") -> one compact JSON
            object with short strings
  plain     no tools: a short exchange in plain ChatML

Tools come from families (files, git, mail, ...); each family's tools share a domain. The
held-out families (HELDOUT_FAMILIES) are never used in training: the evaluation
(tools/tiny_finetune.py tool-eval) asks for their tools only. Parameters are typed by kind:
paths, patterns, free text, urls, names, integers, numbers, booleans, enums, string and integer
arrays, nested objects.
"""
from __future__ import annotations

import json
import random

# ---------------------------------------------------------------- value pools

DIRS = ["src", "lib", "app", "tests", "docs", "scripts", "config", "pkg/core", "web/static", "data",
        "cmd/server", "internal/api", "tools", "examples", "src/utils"]
STEMS = ["main", "utils", "server", "client", "models", "views", "settings", "index", "parser", "cache",
         "auth", "db", "routes", "handlers", "schema", "cli", "report", "notes", "todo", "app"]
EXTS = [".py", ".js", ".ts", ".md", ".json", ".yaml", ".txt", ".toml", ".go", ".rs", ".css", ".html",
        ".sh", ".cfg", ".csv"]
PATTERNS = ["TODO", "FIXME", "def main", "import os", r"class \w+", "*.py", "**/*.md", r"^\s*return",
            "error", r"timeout=\d+", "*.log", "test_*.py", r"\bfoo\b", "raise ValueError", "async def",
            "src/**/*.ts", r"[0-9]+\.[0-9]+", "print(", "*.json", "XXX"]
HOSTS = ["example.com", "api.github.com", "docs.python.org", "localhost:8080", "news.ycombinator.com",
         "httpbin.org", "internal.corp", "status.example.org"]
URL_PATHS = ["", "api/v1/items", "index.html", "users/42", "search?q=mlx", "status", "v2/orders/7",
             "docs/latest"]
PEOPLE = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy"]
CITIES = ["Paris", "Oslo", "Tokyo", "Lima", "Berlin", "Cairo", "Denver", "Mumbai", "Sydney", "Quito",
          "Nairobi", "Madrid"]
TEXTS = ["fix the login bug", "weekly sync", "buy milk", "deploy to staging", "the build is green",
         "review the draft", "call the dentist", "ship it", "meeting moved to 3pm", "lunch at noon",
         "update the docs", "backup done", "flaky test in CI", "new release notes", "hello world",
         "rotate the keys", "refund order 17", "pay the invoice", "check the logs", "all good"]
QUERIES = ["python asyncio tutorial", "best pizza near me", "rust borrow checker", "mlx on linux",
           "weather tomorrow", "how to undo a commit", "sqlite full text search", "cheap flights",
           "zeromq router socket", "json schema enum"]
BRANCHES = ["main", "dev", "feature/login", "fix/crash-on-start", "release-2.1", "hotfix/db", "docs"]
COMMANDS = ["ls -la", "pytest -q", "make build", "git status", "df -h", "uname -a", "npm test",
            "cargo check", "du -sh .", "python -V"]
WORDS = ["alpha", "bravo", "delta", "kilo", "nova", "orbit", "pixel", "quartz", "river", "sigma",
         "tango", "ember", "maple", "cobalt", "falcon"]
LANGS = ["French", "German", "Spanish", "Japanese", "Italian", "Dutch"]
TAGS = ["bug", "ui", "urgent", "backend", "docs", "perf", "security", "infra", "good-first-issue"]
SQL = ["SELECT * FROM users LIMIT 5", "SELECT count(*) FROM orders", "DELETE FROM sessions WHERE expired = 1",
       "SELECT name FROM items WHERE price > 10"]


def _path(r):
    return f"{r.choice(DIRS)}/{r.choice(STEMS)}{r.choice(EXTS)}" if r.random() < 0.85 else \
        f"{r.choice(STEMS)}{r.choice(EXTS)}"


def _email(r):
    return f"{r.choice(PEOPLE)}@example.com"


def _url(r):
    return f"https://{r.choice(HOSTS)}/{r.choice(URL_PATHS)}"


def _ident(r):
    return f"{r.choice(WORDS)}-{r.randint(1, 99)}"


POOL = {"path": _path, "dir": lambda r: r.choice(DIRS) + r.choice(["", "/"]),
        "pattern": lambda r: r.choice(PATTERNS), "url": _url, "text": lambda r: r.choice(TEXTS),
        "query": lambda r: r.choice(QUERIES), "person": lambda r: r.choice(PEOPLE), "email": _email,
        "city": lambda r: r.choice(CITIES), "branch": lambda r: r.choice(BRANCHES),
        "command": lambda r: r.choice(COMMANDS), "ident": _ident, "lang": lambda r: r.choice(LANGS),
        "tag": lambda r: r.choice(TAGS), "sql": lambda r: r.choice(SQL), "word": lambda r: r.choice(WORDS)}

# ---------------------------------------------------------------- parameters


class Param:
    """One parameter: its schema, a value generator and how a request mentions the value."""

    def __init__(self, name, spec, required=False, desc=None):
        self.name, self.required = name, required
        kind, _, arg = spec.partition(":")
        self.kind, self.arg = kind, arg
        words = name.replace("_", " ")
        s: dict
        if kind == "int":
            lo, hi = (int(x) for x in arg.split(","))
            s = {"type": "integer", "minimum": lo, "maximum": hi}
        elif kind == "num":
            s = {"type": "number"}
        elif kind == "bool":
            s = {"type": "boolean"}
        elif kind == "enum":
            s = {"type": "string", "enum": arg.split("|")}
        elif kind == "list":  # list:POOL
            s = {"type": "array", "items": {"type": "string"}}
        elif kind == "ints":
            s = {"type": "array", "items": {"type": "integer"}}
        elif kind == "obj":  # obj:key=spec;key=spec
            self.sub = [Param(k, v, True) for k, v in (kv.split("=", 1) for kv in arg.split(";"))]
            s = {"type": "object", "properties": {p.name: p.schema for p in self.sub},
                 "required": [p.name for p in self.sub]}
        else:  # a string kind from POOL
            s = {"type": "string"}
        s = dict(s)
        s["description"] = desc or words.capitalize()
        self.schema = s
        self.words = words

    def value(self, r):
        k = self.kind
        if k == "int":
            lo, hi = (int(x) for x in self.arg.split(","))
            return r.randint(lo, min(hi, lo + r.choice([10, 100, 1000])))
        if k == "num":
            return round(r.uniform(0, 100), r.choice([0, 1, 2]))
        if k == "bool":
            return r.random() < 0.5
        if k == "enum":
            return r.choice(self.arg.split("|"))
        if k == "list":
            return r.sample([POOL[self.arg](r) for _ in range(6)], r.randint(1, 3))
        if k == "ints":
            return [r.randint(1, 500) for _ in range(r.randint(1, 4))]
        if k == "obj":
            return {p.name: p.value(r) for p in self.sub}
        return POOL[k](r)

    def phrase(self, r, v, first=False):
        """How a request says this parameter's value."""
        w = self.words
        k = self.kind
        if k == "bool":
            return r.choice([f"with {w} {'on' if v else 'off'}", f"{w}: {'yes' if v else 'no'}",
                             f"{w} {'true' if v else 'false'}",
                             f"{'with' if v else 'without'} {w}"])
        if k in ("int", "num"):
            return r.choice([f"with {w} {v}", f"{w} {v}", f"{w} = {v}", f"and {w} set to {v}"])
        if k == "enum":
            return r.choice([f"{w} {v}", f"using {w} {v}", f"({w}: {v})", f"with {v} as {w}"])
        if k in ("list", "ints"):
            items = [str(x) for x in v]
            said = items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
            return r.choice([f"{w} {said}", f"with {w} {said}", f"({w}: {said})"])
        if k == "obj":
            inner = " and ".join(f"{p.words} {v[p.name]}" for p in self.sub)
            return r.choice([f"with {w} {inner}", f"{w}: {inner}"])
        q = r.choice(["", "", "'", '"', "`"]) if k not in ("text", "query") else r.choice(['"', "'", '"'])
        if first and r.random() < 0.6:
            return f"{q}{v}{q}"
        return r.choice([f"{w} {q}{v}{q}", f"with {w} {q}{v}{q}", f"{w}: {q}{v}{q}"])

    def as_arg(self, v):
        return v


class Tool:
    def __init__(self, name, desc, actions, params, family=""):
        self.name, self.desc, self.family = name, desc, family
        self.actions = actions.split("|")
        self.params = [Param(*p) for p in params]

    def spec(self):
        """The OpenAI function shape the daemon passes to the template (intake.template_tool)."""
        props = {p.name: p.schema for p in self.params}
        req = [p.name for p in self.params if p.required]
        return {"type": "function", "function": {"name": self.name, "description": self.desc,
                                                 "parameters": {"type": "object", "properties": props,
                                                                "required": req}}}

    def request(self, r):
        """(user text, arguments): all required parameters and some optional ones, mentioned."""
        chosen = [p for p in self.params if p.required or r.random() < 0.45]
        args = {p.name: p.value(r) for p in chosen}
        bits = [p.phrase(r, args[p.name], first=(i == 0 and p.required)) for i, p in enumerate(chosen)]
        act = r.choice(self.actions)
        body = " ".join([act] + bits) if bits else act
        if r.random() < 0.15:
            body += f" using {self.name}"
        t = r.choice(["{b}", "Please {b}.", "Can you {b}?", "I need you to {b}.", "{b} for me",
                      "Could you {b}, thanks", "{B}.", "Go ahead and {b}.", "hey, {b}", "{B} now."])
        return t.replace("{b}", body).replace("{B}", body[:1].upper() + body[1:]), args


# ---------------------------------------------------------------- families

R, O = True, False
FAMILIES = {
    "files": [
        ("read_file", "Read a text file from the workspace", "read|open|show me|print",
         [("path", "path", R), ("max_lines", "int:1,2000", O)]),
        ("write_file", "Write text to a file, replacing it", "write to|save into|overwrite",
         [("path", "path", R), ("content", "text", R), ("create_dirs", "bool", O)]),
        ("list_directory", "List the entries of a directory", "list|show the files in|ls",
         [("directory", "dir", R), ("recursive", "bool", O), ("limit", "int:1,500", O)]),
        ("delete_file", "Delete a file", "delete|remove|rm", [("path", "path", R), ("force", "bool", O)]),
        ("move_file", "Move or rename a file", "move|rename",
         [("source", "path", R), ("destination", "path", R)])],
    "search": [
        ("grep", "Search file contents with a regular expression", "grep for|search for|find",
         [("pattern", "pattern", R), ("path", "dir", O), ("case_sensitive", "bool", O),
          ("max_results", "int:1,200", O)]),
        ("glob_files", "Find files whose path matches a glob", "find files matching|glob",
         [("pattern", "pattern", R), ("root", "dir", O)]),
        ("web_search", "Search the web", "search the web for|look up|google",
         [("query", "query", R), ("num_results", "int:1,20", O), ("safe", "bool", O)])],
    "git": [
        ("git_commit", "Commit staged changes", "commit|make a commit",
         [("message", "text", R), ("amend", "bool", O), ("files", "list:path", O)]),
        ("git_checkout", "Switch to a branch", "check out|switch to",
         [("branch", "branch", R), ("create", "bool", O)]),
        ("git_log", "Show recent commits", "show the git log|list commits",
         [("branch", "branch", O), ("limit", "int:1,100", O), ("author", "person", O)]),
        ("git_diff", "Show changes of a file", "diff|show the changes in",
         [("path", "path", R), ("staged", "bool", O)])],
    "shell": [
        ("run_command", "Run a shell command", "run|execute",
         [("command", "command", R), ("timeout_s", "int:1,600", O), ("cwd", "dir", O)]),
        ("set_env", "Set an environment variable", "set the env var|export",
         [("name", "word", R), ("value", "text", R)])],
    "web": [
        ("fetch_url", "Fetch a web page", "fetch|download|get",
         [("url", "url", R), ("timeout", "int:1,120", O)]),
        ("http_request", "Send an HTTP request", "send a request to|call the api at",
         [("url", "url", R), ("method", "enum:GET|POST|PUT|DELETE", R),
          ("headers", "obj:accept=enum:json|text;token=ident", O)])],
    "mail": [
        ("send_email", "Send an email", "email|send an email to|mail",
         [("to", "email", R), ("subject", "text", R), ("cc", "list:email", O), ("urgent", "bool", O)]),
        ("read_inbox", "List recent emails", "check my inbox|read my mail",
         [("unread_only", "bool", O), ("limit", "int:1,50", O)])],
    "tasks": [
        ("create_task", "Create a task in the tracker", "create a task|add a todo",
         [("title", "text", R), ("priority", "enum:low|medium|high", O), ("tags", "list:tag", O),
          ("assignee", "person", O)]),
        ("close_task", "Close a task by id", "close task|mark done task",
         [("task_id", "int:1,9999", R), ("comment", "text", O)])],
    "weather": [
        ("get_weather", "Weather forecast for a city", "what is the weather in|get the forecast for",
         [("city", "city", R), ("days", "int:1,7", O), ("unit", "enum:celsius|fahrenheit", O)])],
    "db": [
        ("run_query", "Run a SQL query", "run the query|query the database with",
         [("sql", "sql", R), ("database", "word", O), ("read_only", "bool", O)]),
        ("insert_row", "Insert a row into a table", "insert into|add a row to",
         [("table", "word", R), ("values", "obj:name=person;age=int:1,99", R)])],
    "calendar": [
        ("create_event", "Create a calendar event", "schedule|create an event|book",
         [("title", "text", R), ("start", "enum:09:00|10:30|13:00|15:00|17:30", R),
          ("duration_min", "int:15,240", O), ("attendees", "list:email", O)]),
        ("list_events", "List events of a day", "list my events|what is on my calendar",
         [("day", "enum:monday|tuesday|wednesday|thursday|friday", R)])],
    "math": [
        ("calculate", "Evaluate an arithmetic expression", "calculate|compute|evaluate",
         [("expression", "enum:2+2|17*3|(4+5)/3|2**10|100-58|7*6", R), ("precision", "int:0,10", O)]),
        ("convert_units", "Convert a value between units", "convert",
         [("value", "num", R), ("from_unit", "enum:km|mi|kg|lb|c|f", R), ("to_unit", "enum:km|mi|kg|lb|c|f", R)])],
    "notes": [
        ("add_note", "Save a note", "note|save a note|remember",
         [("text", "text", R), ("pinned", "bool", O), ("labels", "list:tag", O)]),
        ("search_notes", "Search saved notes", "search my notes for|find notes about",
         [("query", "query", R)])],
    # ---- held out: never in training; the evaluation uses these only
    "media": [
        ("resize_image", "Resize an image file", "resize|scale",
         [("image_path", "path", R), ("width", "int:16,4096", R), ("keep_aspect", "bool", O)]),
        ("play_song", "Play a song", "play|put on", [("title", "text", R), ("volume", "int:0,100", O),
                                                    ("shuffle", "bool", O)]),
        ("transcode_video", "Convert a video to another format", "transcode|convert the video",
         [("input_path", "path", R), ("format", "enum:mp4|webm|mkv", R), ("bitrate_kbps", "int:100,20000", O)])],
    "cloud": [
        ("scale_deployment", "Scale a deployment's replicas", "scale|resize the deployment",
         [("deployment", "ident", R), ("replicas", "int:0,50", R), ("namespace", "word", O)]),
        ("restart_service", "Restart a service", "restart|bounce",
         [("service", "word", R), ("graceful", "bool", O)]),
        ("get_logs", "Fetch a service's logs", "show the logs of|tail the logs for",
         [("service", "word", R), ("lines", "int:1,1000", O), ("level", "enum:debug|info|warn|error", O)]),
        ("create_bucket", "Create a storage bucket", "create a bucket|make a bucket",
         [("bucket_name", "ident", R), ("region", "enum:us-east|eu-west|ap-south", R), ("public", "bool", O)])],
    "code": [
        ("run_tests", "Run the test suite", "run the tests in|test",
         [("test_path", "path", R), ("pattern", "pattern", O), ("verbose", "bool", O)]),
        ("format_code", "Format source files", "format|reformat",
         [("paths", "list:path", R), ("line_length", "int:60,200", O)]),
        ("lint_file", "Lint a source file", "lint|check the style of",
         [("file_path", "path", R), ("fix", "bool", O)]),
        ("find_symbol", "Find where a symbol is defined", "find the definition of|locate",
         [("symbol", "word", R), ("kind", "enum:function|class|variable", O)])],
    "shop": [
        ("add_to_cart", "Add a product to the cart", "add to my cart|buy",
         [("product", "word", R), ("quantity", "int:1,20", O)]),
        ("track_order", "Track an order", "track order|where is order",
         [("order_id", "int:1000,99999", R)]),
        ("apply_coupon", "Apply a coupon code", "apply the coupon|use coupon",
         [("code", "ident", R), ("order_id", "int:1000,99999", O)]),
        ("cancel_subscription", "Cancel a subscription plan", "cancel the subscription|unsubscribe",
         [("plan", "enum:basic|plus|pro", R), ("refund", "bool", O), ("reason", "text", O)])],
    "travel": [
        ("book_flight", "Book a flight", "book a flight from|fly from",
         [("origin", "city", R), ("destination", "city", R), ("passengers", "int:1,9", O),
          ("cabin", "enum:economy|business|first", O)]),
        ("find_hotel", "Find hotels in a city", "find a hotel in|search hotels in",
         [("city", "city", R), ("nights", "int:1,30", O), ("max_price", "num", O)]),
        ("get_directions", "Directions between two places", "get directions from|route from",
         [("start", "city", R), ("end", "city", R), ("mode", "enum:walk|drive|transit", O)])],
    "home": [
        ("set_light", "Set a light's brightness", "set the light|dim",
         [("room", "enum:kitchen|bedroom|office|hall", R), ("brightness", "int:0,100", R),
          ("color", "obj:r=int:0,255;g=int:0,255;b=int:0,255", O)]),
        ("set_thermostat", "Set the thermostat", "set the thermostat to|heat to",
         [("temperature", "num", R), ("mode", "enum:heat|cool|auto", O)]),
        ("lock_door", "Lock or unlock a door", "lock|unlock",
         [("door", "enum:front|back|garage", R), ("locked", "bool", R)])],
}
HELDOUT_FAMILIES = ("media", "cloud", "code", "shop", "travel", "home")


# Made-up tools: names and parameters drawn at random, so that the model learns to copy a
# tool's name and its parameters' names from the system turn rather than recall a few. Their
# verbs and nouns leave out every word of a held-out tool's name that no hand-written training
# tool has (get, set, add, create stay: training tools have them too).
VERBS = ["get", "set", "create", "add", "remove", "list", "update", "fetch", "show", "open", "close",
         "start", "stop", "check", "count", "rename", "copy", "sync", "upload", "export", "import",
         "archive", "merge", "split", "sort", "filter", "publish", "validate", "describe", "query",
         "enable", "disable", "assign", "tag", "ping", "measure", "compare", "summarize", "translate",
         "encode", "decode", "compress", "rotate", "refresh", "send", "share", "watch", "pause", "resume",
         "estimate", "predict", "register", "approve", "reject", "schedule", "preview", "render", "deploy"]
NOUNS = ["user", "account", "invoice", "report", "ticket", "record", "table", "column", "index", "queue",
         "message", "channel", "topic", "contact", "meeting", "project", "repo", "branch", "package",
         "library", "module", "secret", "token", "key", "certificate", "domain", "server", "node", "cluster",
         "volume", "backup", "snapshot", "alert", "metric", "dashboard", "chart", "pipeline", "job",
         "worker", "task", "reminder", "alarm", "timer", "playlist", "album", "photo", "document", "page",
         "comment", "review", "label", "issue", "release", "build", "artifact", "config", "setting",
         "profile", "group", "role", "permission", "policy", "quota", "budget", "expense", "payment",
         "customer", "product", "inventory", "shipment", "route", "map", "location", "sensor", "device",
         "printer", "camera", "recipe", "movie", "podcast", "news", "feed", "translation",
         "dictionary", "word", "sentence", "paragraph", "poem", "story", "quiz", "grade", "course",
         "student", "note", "folder", "directory", "archive", "checksum", "hash", "password", "session"]
PARAM_WORDS = ["name", "id", "count", "path", "target", "label", "color", "size", "mode", "level", "query",
               "text", "title", "owner", "region", "limit", "timeout", "depth", "ratio", "enabled",
               "dry_run", "verbose", "items", "ids", "tags", "options", "filters", "source", "dest", "url",
               "email", "user", "group", "project", "version", "port", "host", "channel", "topic", "priority",
               "status", "category", "lang", "unit", "amount", "offset", "page", "width", "height", "note",
               "reason", "comment", "language", "scope", "key", "value", "pattern", "recursive", "force",
               "include_hidden", "max_age", "min_score", "start_date", "end_date", "quality", "speed"]
KINDS = ["path", "dir", "pattern", "url", "text", "query", "person", "email", "city", "ident", "word",
         "int", "int", "num", "bool", "bool", "enum", "enum", "list", "ints", "obj"]


def _rand_param(r, name, required):
    k = r.choice(KINDS)
    if k == "int":
        lo = r.choice([0, 1, 1, 10, 100])
        spec = f"int:{lo},{lo + r.choice([9, 50, 100, 1000, 10000])}"
    elif k == "enum":
        spec = "enum:" + "|".join(r.sample(WORDS + ["low", "high", "fast", "slow", "json", "csv", "all",
                                                    "none", "asc", "desc"], r.randint(2, 4)))
    elif k == "list":
        spec = "list:" + r.choice(["word", "tag", "path", "email", "person", "city"])
    elif k == "obj":
        a, b = r.sample(PARAM_WORDS, 2)
        spec = f"obj:{a}={r.choice(['word', 'int:0,99', 'bool', 'city'])};{b}={r.choice(['int:1,500', 'person', 'enum:on|off'])}"
    else:
        spec = k
    return (name, spec, required)


def random_tool(r) -> Tool:
    verb, noun = r.choice(VERBS), r.choice(NOUNS)
    form = r.random()
    if form < 0.6:
        name, act = f"{verb}_{noun}", f"{verb} the {noun}"
    elif form < 0.75:
        noun2 = r.choice(NOUNS)
        name, act = f"{verb}_{noun}_{noun2}", f"{verb} the {noun} {noun2}"
    elif form < 0.85:
        name, act = f"{noun}_{verb}", f"{verb} the {noun}"
    elif form < 0.93:
        name, act = f"{verb}{noun.capitalize()}", f"{verb} the {noun}"
    else:
        name, act = f"{noun}.{verb}", f"{verb} {noun}"
    words = r.sample(PARAM_WORDS, r.randint(1, 4))
    if r.random() < 0.3:
        words[0] = f"{noun}_{r.choice(['id', 'name', 'path'])}"
    params = [_rand_param(r, w, i == 0 or r.random() < 0.4) for i, w in enumerate(dict.fromkeys(words))]
    return Tool(name, f"{verb.capitalize()} a {noun}", f"{act}|{act}|{verb} {noun}", params, family="made-up")


def tools(split: str) -> list[Tool]:
    """'train' or 'heldout' tools."""
    out = []
    for fam, specs in FAMILIES.items():
        if (fam in HELDOUT_FAMILIES) == (split == "heldout"):
            out += [Tool(*s, family=fam) for s in specs]
    return out


# ---------------------------------------------------------------- conversations

CHITCHAT = [("hi", "Hello! What should I do?"), ("hello there", "Hi! How can I help?"),
            ("thanks!", "You're welcome."), ("thank you, that's all", "Glad to help."),
            ("how are you?", "Fine, thanks. What do you need?"), ("good morning", "Good morning!"),
            ("who are you?", "I am a small assistant that can call tools."),
            ("ok", "Okay."), ("never mind", "Sure, nothing to do then."),
            ("tell me a joke", "Why do programmers mix up Halloween and Christmas? Oct 31 == Dec 25."),
            ("what is python?", "Python is a programming language."), ("bye", "Bye!")]
RESULTS_OK = ["ok", "done", "success", "3 matches", "42 lines", "no changes", "created", "sent"]


def _tool_result(r, tool, args):
    if r.random() < 0.5:
        res = {"ok": True, "result": r.choice(RESULTS_OK)}
        if r.random() < 0.4:
            res["count"] = r.randint(0, 99)
        return json.dumps(res), f"Done: {res['result']}."
    line = r.choice(RESULTS_OK)
    return line, r.choice([f"The {tool.name} call returned: {line}.", f"Result: {line}.", f"{line.capitalize()}."])


def _maybe_system(r, msgs):
    if r.random() < 0.3:
        msgs.insert(0, {"role": "system", "content": r.choice(
            ["You are a helpful assistant.", "You are a coding agent. Use the tools.",
             "Answer briefly.", "You help with tasks on this machine."])})
    return msgs


def _call(tool, args):
    return {"type": "function", "function": {"name": tool.name, "arguments": args}}


def _toolset(r, pool, target):
    k = r.choice([0, 1, 1, 2, 2, 3, 4])
    if target.family == "made-up":  # made-up neighbours, some sharing a word of its name
        others = [random_tool(r) for _ in range(k)]
        for o in others:
            if r.random() < 0.4 and "_" in target.name and "_" in o.name:
                a, b = target.name.split("_", 1)[0], o.name.split("_", 1)[1]
                if f"{a}_{b}" != target.name:
                    o.name = f"{a}_{b}"
        others = [o for o in others if o.name != target.name]
    else:
        others = r.sample([t for t in pool if t is not target], k)
    ts = others + [target]
    r.shuffle(ts)
    return ts


def sample_call(r, pool, with_result=False, made_up=0.0):
    target = random_tool(r) if r.random() < made_up else r.choice(pool)
    ts = _toolset(r, pool, target)
    text, args = target.request(r)
    calls = [_call(target, args)]
    if r.random() < 0.08:  # two calls of the same tool
        t2, a2 = target.request(r)
        text = text.rstrip(".?") + ", and also " + t2[:1].lower() + t2[1:]
        calls.append(_call(target, a2))
    msgs = _maybe_system(r, [{"role": "user", "content": text},
                             {"role": "assistant", "content": "", "tool_calls": calls}])
    if with_result:
        for i, c in enumerate(calls):
            res, answer = _tool_result(r, target, c["function"]["arguments"])
            msgs.append({"role": "tool", "tool_call_id": f"call_{i}", "content": res})
        msgs.append({"role": "assistant", "content": answer})
        if r.random() < 0.35:
            nxt = r.choice(ts) if r.random() < 0.7 else target
            t3, a3 = nxt.request(r)
            msgs += [{"role": "user", "content": t3},
                     {"role": "assistant", "content": "", "tool_calls": [_call(nxt, a3)]}]
    return {"messages": msgs, "tools": [t.spec() for t in ts]}


def sample_chat(r, pool, made_up=0.0):
    ts = [random_tool(r) if r.random() < made_up else r.choice(pool) for _ in range(r.randint(1, 4))]
    q, a = r.choice(CHITCHAT)
    if r.random() < 0.25:
        x, y = r.randint(1, 50), r.randint(1, 50)
        q, a = f"what is {x} + {y}?", str(x + y)
    elif r.random() < 0.15:
        q, a = "what tools do you have?", "I can call: " + ", ".join(t.name for t in ts) + "."
    return {"messages": _maybe_system(r, [{"role": "user", "content": q}, {"role": "assistant", "content": a}]),
            "tools": [t.spec() for t in ts]}


JSON_KEYS = [("verdict", "enum:approve|revise|reject"), ("confidence", "int:0,9"), ("reason", "text"),
             ("summary", "text"), ("score", "int:0,100"), ("ok", "bool"), ("city", "city"),
             ("language", "lang"), ("tags", "list:tag"), ("name", "person"), ("sentiment", "enum:positive|negative|neutral"),
             ("answer", "word"), ("count", "int:0,50"), ("path", "path"), ("label", "word"), ("title", "text")]
QUESTIONS = ["Should the council adopt the Stack class?", "Review this change: add a cache to the parser.",
             "Classify the sentiment of: 'great job, thanks'", "Summarize the meeting notes.",
             "Is the build healthy?", "Extract the city from: 'I moved to Oslo last year'",
             "Rate the code quality of utils.py.", "Give a verdict on the pull request.",
             "Which file should I edit to fix the login?", "Describe the bug report briefly.",
             "Pick a name for the new service.", "Tag this issue: crash on start in the UI."]


def sample_json(r):
    keys = r.sample(JSON_KEYS, r.randint(1, 4))
    ps = [Param(k, spec, True) for k, spec in keys]
    schema = {"type": "object", "properties": {p.name: {k: v for k, v in p.schema.items() if k != "description"}
                                               for p in ps},
              "required": [p.name for p in ps], "additionalProperties": False}
    obj = {p.name: p.value(r) for p in ps}
    q = r.choice(QUESTIONS)
    if r.random() < 0.6:
        msgs = [{"role": "system", "content": "Reply with a JSON object that matches this JSON Schema:\n"
                 + json.dumps(schema)}, {"role": "user", "content": q}]
    else:
        msgs = [{"role": "user", "content": q + r.choice([" Answer in JSON.", " Reply as JSON.",
                                                          " JSON only, keys: " + ", ".join(obj) + "."])}]
    sep = r.choice([(", ", ": "), (",", ":")])
    msgs.append({"role": "assistant", "content": json.dumps(obj, separators=sep)})
    return {"messages": msgs, "tools": None}


PLAIN = [("Write a Python function that adds two numbers.", "def add(a, b):\n    return a + b"),
         ("Say hello.", "Hello!"), ("What is 3 times 4?", "12"),
         ("Name a sorting algorithm.", "Merge sort."),
         ("Reverse a list in Python.", "items[::-1]")]


def sample(r, pool, mix=(("call", 0.5), ("result", 0.17), ("chat", 0.1), ("json", 0.18), ("plain", 0.05)),
           made_up=0.0):
    x = r.random()
    for kind, p in mix:
        if x < p:
            break
        x -= p
    if kind == "call":
        return sample_call(r, pool, made_up=made_up)
    if kind == "result":
        return sample_call(r, pool, with_result=True, made_up=made_up)
    if kind == "chat":
        return sample_chat(r, pool, made_up=made_up)
    if kind == "json":
        return sample_json(r)
    q, a = r.choice(PLAIN)
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}], "tools": None}


def generate(n: int, seed: int = 0, split: str = "train", made_up: float = 0.65) -> list[dict]:
    """n samples; in training, a share ``made_up`` of the tool samples use made-up tools."""
    r = random.Random(seed)
    pool = tools(split)
    return [sample(r, pool, made_up=made_up if split == "train" else 0.0) for _ in range(n)]


def eval_cases(n_per_tool: int = 1, seed: int = 4141) -> list[dict]:
    """Action requests for held-out tools, each among 0-3 other held-out tools: the prompt
    (messages, tools) and the expected tool name. The prompt ends before the assistant turn."""
    r = random.Random(seed)
    pool = tools("heldout")
    out = []
    for t in pool:
        for _ in range(n_per_tool):
            ts = _toolset(r, pool, t)
            text, args = t.request(r)
            out.append({"messages": [{"role": "user", "content": text}], "tools": [x.spec() for x in ts],
                        "expect": t.name, "args": args})
    return out


def chitchat_cases(seed: int = 4142) -> list[dict]:
    r = random.Random(seed)
    pool = tools("heldout")
    return [{"messages": [{"role": "user", "content": q}], "tools": [t.spec() for t in r.sample(pool, 2)]}
            for q, _ in CHITCHAT]
