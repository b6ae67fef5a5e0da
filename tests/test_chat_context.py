"""Follow-up prompts extend the exact tokens of the conversation, not its text rendered again.

Text a model generated does not always tokenise back to the tokens it generated (`"\n\n"` can
come out as two newline tokens, a reply can end inside a character); a prompt rendered from the
stored text would then differ from the KV computed for the previous turn, and every tier would
miss from that token on.
"""

from __future__ import annotations

import pytest

from antiphon.engine_ext.config import EngineConfig
from antiphon.engine_ext.scripted import ScriptedEngine
from antiphon.engine_ext.types import ChatContext, ChatTurn
from antiphon.engine_ext.vllm_engine import VllmEngine
from tests.conftest import default_model_or_skip

HISTORY = [ChatTurn("user", "Write two short paragraphs."),
           ChatTurn("assistant", "First one.\n\nSecond one.")]
NEXT = ChatTurn("user", "Thanks! Now a third?")


@pytest.fixture(scope="module")
def engine() -> VllmEngine:
    """The default model's tokenizer and chat template, without starting vLLM."""
    eng = VllmEngine(EngineConfig(), default_model_or_skip())
    eng.load_tokenizer()
    return eng


def generated_as(engine: VllmEngine, pieces: list[str]) -> list[int]:
    """Token ids of a reply generated one token per piece (a vocabulary token each)."""
    ids = [engine.tokenizer.hf.convert_tokens_to_ids(engine.tokenizer.hf.tokenize(p)) for p in pieces]
    assert all(len(i) == 1 for i in ids[1:2]), "the middle piece must be a single token"
    return [t for i in ids for t in i]


def test_the_follow_up_extends_the_generated_tokens_not_their_text(engine: VllmEngine) -> None:
    prompt = engine.render_chat(HISTORY[:1])
    # SmolLM2 generates "\n\n" as one token; its text tokenises back as two "\n" tokens.
    reply = generated_as(engine, ["First one.", "\n\n", "Second one."])
    assert engine.decode(reply) == HISTORY[1].content
    rendered = engine.render_chat([*HISTORY, NEXT])
    assert rendered[:len(prompt) + len(reply)] != [*prompt, *reply]  # text drifts off them

    end_of_turn = engine.tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    context = ChatContext(2, engine.context_tokens(prompt, [*reply, end_of_turn]))
    assert context.token_ids == (*prompt, *reply)  # the stop token is not context
    follow_up = engine.continue_chat([*HISTORY, NEXT], context)
    assert follow_up[:len(context.token_ids)] == list(context.token_ids)
    assert engine.decode(follow_up) == engine.decode(rendered)  # the same text for the model
    # The advisory's context (no reply opened) extends it the same way.
    closed = engine.continue_chat(HISTORY, context, open_reply=False)
    assert closed[:len(context.token_ids)] == list(context.token_ids)
    assert engine.decode(closed) == engine.decode(engine.render_chat(HISTORY, open_reply=False))


def test_a_context_that_is_not_the_history_is_not_used(engine: VllmEngine) -> None:
    prompt = engine.render_chat(HISTORY[:1])
    other = generated_as(engine, ["Something else entirely."])
    rendered = engine.render_chat([*HISTORY, NEXT])
    stale = ChatContext(2, (*prompt, *other))
    assert engine.continue_chat([*HISTORY, NEXT], stale) == rendered
    wrong_turn = ChatContext(1, tuple(prompt))  # message 0 is the user's, not a reply
    assert engine.continue_chat([*HISTORY, NEXT], wrong_turn) == rendered
    beyond = ChatContext(5, tuple(prompt))
    assert engine.continue_chat([*HISTORY, NEXT], beyond) == rendered
    assert engine.continue_chat([*HISTORY, NEXT], None) == rendered


def test_the_scripted_engine_continues_its_own_context() -> None:
    engine = ScriptedEngine()
    prompt = engine.render_chat(HISTORY[:1])
    context = ChatContext(2, engine.context_tokens(prompt, [ord(c) for c in HISTORY[1].content]))
    assert engine.continue_chat([*HISTORY, NEXT], context) == engine.render_chat([*HISTORY, NEXT])


# Mistral's rule, in the way its template words it: roles alternate, the user's first.
ALTERNATING_TEMPLATE = (
    "{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}")


def test_a_template_that_wants_roles_to_alternate_sees_a_run_of_user_messages_as_one() -> None:
    """A message left without a reply (the server went down while answering it) and the next
    one are two user messages in a row, which OpenAI's API takes and templates like Mistral's
    refuse: the model sees them as one message, and the previous turn's KV is still reused."""
    strict = VllmEngine(EngineConfig(), default_model_or_skip())
    strict.load_tokenizer()
    strict.tokenizer.hf.chat_template = ALTERNATING_TEMPLATE
    unanswered, latest = ChatTurn("user", "Are you there?"), ChatTurn("user", "Hello?")
    turns = [*HISTORY, unanswered, latest]
    assert strict.decode(strict.render_chat(turns)) == (
        "[INST] Write two short paragraphs. [/INST]First one.\n\nSecond one.</s>"
        "[INST] Are you there?\n\nHello? [/INST]")
    prompt = strict.render_chat(HISTORY[:1])
    reply = strict.encode_prompt(HISTORY[1].content, add_special_tokens=False)
    context = ChatContext(2, strict.context_tokens(prompt, reply))
    follow_up = strict.continue_chat(turns, context)
    assert follow_up[:len(context.token_ids)] == list(context.token_ids)
    assert strict.decode(follow_up) == strict.decode(strict.render_chat(turns))
    # What else it refuses, it still refuses.
    from antiphon.engine_ext.engine import EngineRequestError
    with pytest.raises(EngineRequestError, match="roles must alternate"):
        strict.render_chat([HISTORY[1], NEXT])
    with pytest.raises(EngineRequestError, match="roles must alternate"):
        strict.render_chat([NEXT, HISTORY[1], HISTORY[1]])


def test_a_text_longer_than_the_model_counts_without_a_warning(engine: VllmEngine) -> None:
    """The server refuses such a message itself; transformers' tokenizer logged that its
    length "will result in indexing errors" on the way."""
    assert engine.count_tokens("word " * 20_000) > 10_000
    warned = engine.tokenizer.hf.deprecation_warnings
    assert not warned.get("sequence-length-is-longer-than-the-specified-maximum")
