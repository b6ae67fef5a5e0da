"""A model's tokenizer and chat template, as the engine renders and counts with them."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from antiphon.engine_ext.engine import EngineRequestError
from antiphon.engine_ext.tool_calls import CALL_CLOSE, CALL_OPEN, hermes_turns, tool_message
from antiphon.engine_ext.types import ChatTurn, ToolSpec


class ChatTokenizer:
    """The Hugging Face tokenizer of the model in `model_dir` (`hf`), loaded once."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.hf: Any = AutoTokenizer.from_pretrained(str(model_dir))
        # Antiphon checks lengths against the served context itself (a message refused as
        # too long logged transformers' "Token indices sequence length is longer than the
        # specified maximum" warning, which said it "will result in indexing errors").
        self.hf.model_max_length = int(1e30)  # transformers' own "no limit"
        self.special_token_ids = frozenset(self.hf.all_special_ids)
        # Whether this model's <tool_call> tags are special tokens, which vLLM drops from a
        # reply's text unless told not to (Hermes-family models mark them so): only then are
        # special tokens kept while tools are offered, as vLLM's Hermes parser has it. Kept
        # for every model, Mistral's [TOOL_CALLS] and Llama 3.1's <|python_tag|> came with the
        # calls, which were then read as text.
        specials = {token.content for token in self.hf.added_tokens_decoder.values()
                    if token.special}
        self.tool_tags_are_special = bool({CALL_OPEN, CALL_CLOSE} & specials)

    def render_chat(self, turns: Sequence[ChatTurn], *, open_reply: bool = True,
                    tools: Sequence[ToolSpec] = ()) -> list[int]:
        """`Engine.render_chat`: the prompt token ids of a conversation."""
        extra: dict[str, Any] = {}
        if self.template_knows_tools:
            if tools:
                extra["tools"] = [t.to_json() for t in tools]
        else:
            turns = hermes_turns(turns, tools)
        try:
            text = self._apply_template(turns, open_reply, extra)
        except EngineRequestError:
            # Templates that want roles to alternate (Mistral's, Gemma's) refuse two user
            # messages in a row, which OpenAI's API takes and a session holds after a message
            # left without a reply (a crash, a failed turn) is followed by another: the model
            # then sees each run of them as one message.
            joined = joined_user_runs(turns)
            if len(joined) == len(turns):
                raise
            text = self._apply_template(joined, open_reply, extra)
        return list(self.hf.encode(text, add_special_tokens=False))

    def _apply_template(self, turns: Sequence[ChatTurn], open_reply: bool,
                        extra: dict[str, Any]) -> str:
        from jinja2 import TemplateError

        try:
            return str(self.hf.apply_chat_template(
                [tool_message(t) for t in turns], add_generation_prompt=open_reply,
                tokenize=False, **extra))
        # the template's own checks (roles, tool call ids, ...), and its filters given what
        # they cannot take (`items` of arguments that are not an object)
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError,
                IndexError) as exc:
            raise EngineRequestError(f"the model's chat template refused the "
                                     f"conversation: {exc}") from exc

    @functools.cached_property
    def template_knows_tools(self) -> bool:
        """The chat template renders `tools` and calls itself (it names them), so the model
        sees them as it was trained to; else Antiphon writes them in the Hermes format."""
        template = self.hf.chat_template
        texts = template.values() if isinstance(template, dict) else [template or ""]
        return any("tools" in text and "tool_calls" in text for text in texts)

    def count_tokens(self, text: str) -> int:
        """Number of tokens of a plain text (no special tokens)."""
        return len(self.hf.encode(text, add_special_tokens=False))

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a plain-text prompt, as vLLM encodes it."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of token ids, special tokens included."""
        return str(self.hf.decode(list(token_ids), skip_special_tokens=False))

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's string as the vocabulary has it."""
        return [str(t) for t in self.hf.convert_ids_to_tokens(list(token_ids))]


def joined_user_runs(turns: Sequence[ChatTurn]) -> list[ChatTurn]:
    """`turns` with each run of consecutive user messages made one, their texts a blank line
    apart."""
    out: list[ChatTurn] = []
    for turn in turns:
        if out and turn.role == "user" and out[-1].role == "user":
            out[-1] = ChatTurn("user", f"{out[-1].content}\n\n{turn.content}")
        else:
            out.append(turn)
    return out
