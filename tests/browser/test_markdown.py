"""The reply renderer (web_ui/static/markdown.js) on what models write: fences with more than a
language after them, code indented under a list item, and long lines of unclosed emphasis
markers while a reply streams (scripted engine: the server only serves the page)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from antiphon.engine_ext.scripted import ScriptedEngine
from tests.conftest import scripted_config
from tests.liveserver import live_server

pytestmark = pytest.mark.browser

# Renders each text of `texts` (name -> Markdown) into a detached div; name -> its HTML.
RENDER = """async (texts) => {
  const { renderMarkdown } = await import('/static/markdown.js');
  const out = {};
  for (const [name, text] of Object.entries(texts)) {
    const div = document.createElement('div');
    div.append(renderMarkdown(text));
    out[name] = div.innerHTML;
  }
  return out;
}"""


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with live_server(scripted_config(tmp_path_factory.mktemp("md")), ScriptedEngine()) as base:
        yield base


@pytest.fixture
def md(url: str, page: Any) -> Any:
    page.goto(url + "/static/index.html")
    return page


def code_block(lang: str, code: str) -> str:
    return (f'<div class="md-code"><div class="md-code-head">{lang}<button class="md-copy btn'
            f' btn-ghost" type="button">Copy</button></div><pre><code data-lang="{lang}">'
            f"{code}</code></pre></div>")


def test_a_fence_with_words_after_its_language_closes_where_it_ends(md: Any) -> None:
    # An info string past the language was text, so the closing fence opened a block that
    # swallowed the rest of the reply.
    after = "\nThen run **npm test**.\n\n## Next"
    html = md.evaluate(RENDER, {
        "highlight": "Here:\n```js {2}\nconst a = 1;\n```" + after,
        "title": '```python title="a.py"\nprint(1)\n```' + after,
        "rmarkdown": "```{r}\nx <- 1\n```" + after,
        "pandoc": "~~~ {.haskell .numberLines}\nmain = pure ()\n~~~" + after,
    })
    rest = "<p>Then run <strong>npm test</strong>.</p><h4 class=\"md-heading\">Next</h4>"
    assert html["highlight"] == "<p>Here:</p>" + code_block("js", "const a = 1;") + rest
    assert html["title"] == code_block("python", "print(1)") + rest
    assert html["rmarkdown"] == code_block("r", "x &lt;- 1") + rest
    assert html["pandoc"] == code_block("haskell", "main = pure ()") + rest


def test_a_fence_indented_under_a_list_item_is_code_in_that_item(md: Any) -> None:
    # It was a paragraph, its asterisks emphasis: def f(<em>args, *</em>kwargs)
    code = "def f(*args, **kwargs):\n    return 1"
    indented = "".join(f"    {line}\n" for line in code.split("\n"))
    html = md.evaluate(RENDER, {
        "bullet": f"- Install it:\n    ```python\n{indented}    ```\n- Done",
        "blank line": f"- Install it:\n\n    ```python\n{indented}    ```\n\n- Done",
        "numbered": "1. Run:\n   ```sh\n   make test\n   ```\n2. Done",
        "streaming": "- Install it:\n    ```python\n    def f(",  # not closed yet
    })
    item = f"<li>Install it:{code_block('python', code)}</li>"
    assert html["bullet"] == f"<ul>{item}<li>Done</li></ul>"
    assert html["blank line"] == f"<ul>{item}</ul><ul><li>Done</li></ul>"  # (loose: two lists)
    assert html["numbered"] == f'<ol start="1"><li>Run:{code_block("sh", "make test")}</li>' \
        "<li>Done</li></ol>"
    assert html["streaming"] == f"<ul><li>Install it:{code_block('python', 'def f(')}</li></ul>"


def test_a_long_line_of_unclosed_markers_renders_in_linear_time(md: Any) -> None:
    """A streaming reply is rendered again at every frame: each unclosed "*" scanned the rest
    of its line, and a 60 KB line of them took over a second a frame."""
    timings = md.evaluate("""async () => {
      const { renderMarkdown } = await import('/static/markdown.js');
      const out = {};
      for (const text of ['*a '.repeat(20000), ' _a'.repeat(20000), '**a '.repeat(15000),
                          '__a '.repeat(15000), '[a '.repeat(20000), '`a'.repeat(30000)]) {
        renderMarkdown(text); // (compiled and warm)
        const t0 = performance.now();
        renderMarkdown(text);
        out[text.slice(0, 4)] = performance.now() - t0;
      }
      return out;
    }""")
    assert all(ms < 300 for ms in timings.values()), timings
    # and the spans that do close render as before
    html = md.evaluate(RENDER, {"spans": "*a* **b** _c_ __d__ `e` [f](https://x.org) *g _h*"})
    assert html["spans"] == ('<p><em>a</em> <strong>b</strong> <em>c</em> <strong>d</strong>'
                             ' <code>e</code> <a href="https://x.org" rel="noopener noreferrer'
                             ' nofollow" target="_blank">f</a> <em>g _h</em></p>')
