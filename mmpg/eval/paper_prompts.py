"""The papers' grounding prompts, read from the papers' own source files (mmpg ships none of their text).

A published protocol's numbers depend on the prompt word for word, so `--protocol time_r1` (and the other papers'
protocols) prompts with the paper's own text. That text is the paper's, not mmpg's: the user fetches the one file
of the paper's repository that holds it, pinned to the commit the protocol was read at, and passes it as
`prompt_file=`. mmpg reads the string from that Python file without running it (`ast` finds the assignment,
`ast.literal_eval` reads its literal value) and turns the paper's marker for the sentence into `{query}`:

    Time-R1       src/vllm_inference/data/config.py   DEFAULT_TG_PROMPT['r1']   "{}"       (str.format)
    VideoChat-R1  src_eval/eval_prompts.py            GROUND_TEMPLATE_THINK     "[EVENT]"  (str.replace)
    TimeLens      evaluation/utils.py                 GROUNDER_PROMPT           "{}"       (str.format)

Why a file the user fetches rather than a download by mmpg: evaluation nodes are often offline, the file is pinned
and visible, and the report records the whole prompt text it produced (eval.json's `template_text`).
"""

from __future__ import annotations

import ast
import dataclasses
import string
from pathlib import Path

from mmpg.errors import UserError


@dataclasses.dataclass(frozen=True)
class PromptSource:
    """Where a paper keeps its grounding prompt: the string assigned to `variable` (its `key` when it is a dict) in
    `path` of the GitHub repository `repo` at `commit`; `marker` is where the sentence goes."""

    repo: str
    commit: str
    path: str
    variable: str
    key: str | None
    marker: str  # "{}": the code calls prompt.format(sentence); "[EVENT]": prompt.replace("[EVENT]", sentence)
    save_as: str  # where the documented commands keep the fetched file

    @property
    def url(self) -> str:
        return f"https://raw.githubusercontent.com/{self.repo}/{self.commit}/{self.path}"

    @property
    def name(self) -> str:
        return self.variable + (f"[{self.key!r}]" if self.key is not None else "")

    @property
    def where(self) -> str:
        return f"{self.repo}, {self.path}, {self.name}, whose {self.marker} becomes {{query}}"

    def fetch_command(self) -> str:
        return f"curl -fL --create-dirs -o {self.save_as} {self.url}"


TIME_R1 = PromptSource("xiaomi-research/time-r1", "7f2b5944a0c35993da80634a459d5a48a3a5431e",
                       "src/vllm_inference/data/config.py", "DEFAULT_TG_PROMPT", "r1", "{}", "data/prompts/time_r1.py")
VIDEOCHAT_R1 = PromptSource("OpenGVLab/VideoChat-R1", "73b2ea9ac83ad5c0bcd893bffd1cbb2e7c167068",
                            "src_eval/eval_prompts.py", "GROUND_TEMPLATE_THINK", None, "[EVENT]",
                            "data/prompts/videochat_r1.py")
TIMELENS = PromptSource("TencentARC/TimeLens", "5d90c067246ddb11db3203adbb0085bdc48d9e5e", "evaluation/utils.py",
                        "GROUNDER_PROMPT", None, "{}", "data/prompts/timelens.py")
SOURCES = (TIME_R1, VIDEOCHAT_R1, TIMELENS)


def _assignments(tree: ast.Module) -> dict[str, ast.expr]:
    """Module-level `NAME = value` (and `NAME: T = value`) assignments: name -> the value's expression."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            found[node.target.id] = node.value
    return found


def _as_template(text: str, marker: str, where: str) -> str:
    """The paper's prompt with its marker made `{query}` and every other brace doubled (mmpg formats the result)."""
    if marker == "{}":  # str.format: literal braces are already doubled in the source, the one field is the sentence
        out, fields = [], 0
        for literal, field, spec, conversion in string.Formatter().parse(text):
            out.append(literal.replace("{", "{{").replace("}", "}}"))
            if field is not None:
                if field not in ("", "0") or spec or conversion:
                    raise UserError(f"{where}: the prompt has a field {{{field}}} where one {{}} was expected")
                fields += 1
                out.append("{query}")
        if fields != 1:
            raise UserError(f"{where}: the prompt has {fields} {{}} fields, not the one the sentence goes into")
        return "".join(out)
    if marker not in text:
        raise UserError(f"{where}: the prompt holds no {marker}, where the sentence goes")
    return text.replace("{", "{{").replace("}", "}}").replace(marker, "{query}")


def read_paper_prompt(path: str | Path) -> str:
    """The user text of the paper's prompt held in the Python file `path` (one of SOURCES' files), `{query}` where
    the sentence goes; the file is parsed, never run. UserError (one line) when it holds none of them."""
    file = Path(path).expanduser()
    try:
        tree = ast.parse(file.read_text(encoding="utf-8-sig"), filename=str(file))
    except (SyntaxError, UnicodeDecodeError) as e:
        raise UserError(f"prompt_file {path}: not a readable Python file ({e.__class__.__name__}: {e})") from None
    assigned = _assignments(tree)
    found = [s for s in SOURCES if s.variable in assigned]
    if not found:
        raise UserError(f"prompt_file {path}: a Python file that assigns none of the papers' prompts ("
                        + "; ".join(s.where for s in SOURCES) + "); pass the paper's file or a text file with {query}")
    source = found[0]
    where = f"prompt_file {path}, {source.name}"
    try:
        value = ast.literal_eval(assigned[source.variable])
    except ValueError:
        raise UserError(f"{where}: not a literal string (or dict of them); mmpg reads it without running the file"
                        ) from None
    if source.key is not None:
        if not isinstance(value, dict) or source.key not in value:
            raise UserError(f"{where}: {source.variable} has no key {source.key!r}")
        value = value[source.key]
    if not isinstance(value, str):
        raise UserError(f"{where}: a {type(value).__name__}, not a string")
    return _as_template(value, source.marker, where)
