"""How the library file is built, measured from its syntax tree (issue 24's measures).

    python benchmarks/structure.py [FILE]                         # the contract counts and own code
    python benchmarks/structure.py [FILE] --closure FIREPositionalEmbedding

The counts: ``score_mod`` / ``forward(q_len, k_len)`` / ``encode_qk`` definitions, calls that build
default positions, ``owner = type(self).__name__`` lines, and the own code (no docstrings, comments
or blank lines) of twelve encodings. ``--closure CLS``: every module-level definition CLS pulls in,
transitively, with its lines sorted by a heuristic into docstring, validation (``_check*`` / ``_as_*``
functions, ``if ...: raise`` blocks), plumbing (framework helpers and the bases' contract methods)
and maths (the rest). A heuristic: read its numbers as a trend, not a verdict.
"""
import ast
import re
import sys

args = [a for a in sys.argv[1:] if not a.startswith("--")]
path = args[0] if args and args[0].endswith(".py") else "positional_embeddings.py"
if "--closure" in sys.argv:
    name = sys.argv[sys.argv.index("--closure") + 1]
    src = open(path).read(); lines = src.split("\n"); tree = ast.parse(src)
    defs = {}
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)): defs[n.name] = n
        elif isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Name): defs[t.id] = n
    seen, todo = [], [name]
    while todo:
        d = todo.pop()
        if d in seen or d not in defs: continue
        seen.append(d)
        for sub in ast.walk(defs[d]):
            if isinstance(sub, ast.Name) and sub.id in defs: todo.append(sub.id)
    VALIDATION = ("_check", "_as_", "_is_bool", "_describe", "_one_of", "_positive_float", "_non_negative_float",
                  "_frequency_base", "_even_int", "_declared_check", "_checking_arguments", "_ARGUMENTS", "_reject",
                  "_module_or_none", "_LARGEST")
    PLUMBING = ("_is_compiling", "_is_exporting", "_surely", "_uninitialised", "_current_default_device", "_is_dtensor",
                "_full", "_copy_into", "_with_parameters", "_row_lookup", "_dense_score_mod", "_skip_value_checks",
                "_compiled_flex", "_COMPILED", "_flex", "_block_mask", "_StraightThrough", "_clamp_straight")
    PLUMBING_METHODS = ("_apply", "_buffer_device", "__init_subclass__", "_gathered_call", "reset_parameters",
                        "_init_buffers", "extra_repr", "_bound_input", "_load_from_state_dict", "forward_input",
                        "_prepared", "_validated", "_check_attention_shapes", "_check_heads", "_check_qk",
                        "full_precision_logits", "attention_values", "logit_scale", "is_causal", "score_mod", "forward",
                        "attention_bias", "encode_qk", "forward_attn")
    counts = {"docstring": 0, "validation": 0, "plumbing": 0, "maths": 0}
    def docstring_lines(node):
        out = set()
        for n in ast.walk(node):
            if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.body and isinstance(n.body[0], ast.Expr) \
                    and isinstance(getattr(n.body[0], "value", None), ast.Constant) and isinstance(n.body[0].value.value, str):
                out.update(range(n.body[0].lineno, n.body[0].end_lineno + 1))
        return out
    def raise_blocks(node):
        out = set()
        for n in ast.walk(node):
            if isinstance(n, ast.If) and all(isinstance(b, ast.Raise) for b in n.body) and not n.orelse:
                out.update(range(n.lineno, n.end_lineno + 1))
            if isinstance(n, ast.Raise):
                out.update(range(n.lineno, n.end_lineno + 1))
        return out
    def classify(node, default):
        doc, val = docstring_lines(node), raise_blocks(node)
        method_kind = {}
        if isinstance(node, ast.ClassDef):
            for f in node.body:
                if isinstance(f, ast.FunctionDef):
                    k = "plumbing" if f.name in PLUMBING_METHODS or f.name.startswith("_check") else None
                    if f.name == "__init__": k = "validation_init"
                    for i in range(f.lineno, f.end_lineno + 1): method_kind[i] = k
        for i in range(node.lineno, node.end_lineno + 1):
            s = lines[i - 1].strip()
            if not s: continue
            if i in doc or s.startswith("#"): counts["docstring"] += 1
            elif i in val or "_check" in s and "(" in s and "=" not in s.split("(")[0]: counts["validation"] += 1
            elif method_kind.get(i) == "plumbing": counts["plumbing"] += 1
            else: counts[default] += 1
    for d in seen:
        node = defs[d]
        default = "validation" if d.startswith(VALIDATION) else "plumbing" if d.startswith(PLUMBING) or d in ("PositionalEmbedding",) else "maths"
        classify(node, default)
    total = sum(counts.values())
    print(f"{name}: {len(seen)} definitions, {total} lines: " + ", ".join(f"{k} {v}" for k, v in counts.items()),
          f"| maths {counts['maths'] / total:.0%} of all, {counts['maths'] / (total - counts['docstring']):.0%} of code")
    print("  ", " ".join(seen))
    sys.exit()
src = open(path).read()
lines = src.splitlines()
tree = ast.parse(src)

def code_lines(node):
    """Source lines of node without docstrings, comments, blank lines."""
    doc = set()
    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Module)) and n.body and isinstance(n.body[0], ast.Expr) \
                and isinstance(getattr(n.body[0], "value", None), ast.Constant) and isinstance(n.body[0].value.value, str):
            doc.update(range(n.body[0].lineno, n.body[0].end_lineno + 1))
    keep = []
    for i in range(node.lineno, node.end_lineno + 1):
        s = lines[i - 1].strip()
        if i in doc or not s or s.startswith("#"):
            continue
        keep.append(i)
    return keep

classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
funcs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
score_mod = sum(1 for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "score_mod")
fwd = sum(1 for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "forward"
          and len(n.args.args) > 2 and n.args.args[1].arg == "q_len")
fwd_any = sum(1 for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "forward"
          and len(n.args.args) > 1 and n.args.args[1].arg in ("q_len", "x") and any(a.arg == "k_len" for a in n.args.args))
enc = sum(1 for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "encode_qk")
defaults = sum(1 for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
               and n.func.id in ("_or_default", "_default_positions"))
owner = len(re.findall(r"owner = type\(self\)\.__name__", src))
print(f"score_mod defs {score_mod}; forward(q_len, k_len) {fwd} (+{fwd_any - fwd} forward(x, k_len)); encode_qk {enc}; "
      f"default-position calls {defaults}; owner= {owner}")
names = ["T5PositionalEmbedding", "ALiBiPositionalEmbedding", "KerplePositionalEmbedding", "SandwichPositionalEmbedding",
         "FIREPositionalEmbedding", "DynamicPositionBias", "CoPEPositionalEmbedding", "ShawPositionalEmbedding",
         "DebertaPositionalEmbedding", "XPosPositionalEmbedding", "ForgettingPositionalEmbedding",
         "TransformerXLPositionalEmbedding"]
total = 0
for name in names:
    c = len(code_lines(classes[name])); total += c
    print(f"  {name:36s} {c:4d}")
print(f"  own code of the 12: {total}")
for name in ["RotaryPositionalEmbedding", "ALiBiPositionalEmbedding", "FIREPositionalEmbedding", "HeinsenPositionalEmbedding",
             "T5PositionalEmbedding", "ShawPositionalEmbedding"]:
    n = classes[name]
    print(f"  {name}: class {n.end_lineno - n.lineno + 1} lines, own code {len(code_lines(n))}")
