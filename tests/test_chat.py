"""Chat templates rendered by splitspec.text.chat against transformers' apply_chat_template."""

from __future__ import annotations

import pytest
from tests.test_tokenizer_transformers import _sentencepiece_gguf
from tests.tools import write_gguf

from splitspec.text.chat import ChatTemplate, ChatTemplateError
from splitspec.text.tokenizer import Tokenizer, byte_level_vocab, write_gguf_tokenizer

transformers = pytest.importorskip("transformers")

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Whitespace control, namespace, loop controls, tojson on non-ASCII, defined-ness of the special
# tokens and of tools, raise_exception: what real templates lean on.
RICH = """
{%- set ns = namespace(system='', turns=0) -%}
{%- if tools is not none %}{{ raise_exception('no tools here') }}{% endif -%}
{%- for message in messages -%}
    {%- if message['role'] == 'system' -%}
        {%- set ns.system = message['content'] -%}
        {%- continue -%}
    {%- endif -%}
    {%- if message['role'] not in ['user', 'assistant'] -%}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {%- endif -%}
    {%- set ns.turns = ns.turns + 1 %}
{{ bos_token if bos_token is defined else '' }}[{{ ns.turns }}] {{ message['role'] | upper }}: {{ message['content'] | trim }}
    {%- if loop.first and ns.system %} (system: {{ ns.system | tojson }}){% endif %}
    {% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}
{%- endfor -%}
{%- if add_generation_prompt %}
[{{ ns.turns + 1 }}] ASSISTANT:
{%- endif -%}
"""
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "Be brief — très bref, 简短."},
        {"role": "user", "content": "  What is 2+2?\n"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And \"quoted\" <b>html</b> & emoji 😀?"},
    ],
]


@pytest.fixture(scope="module", params=["chatml", "rich", "rich-sentencepiece"])
def template_pair(request, tmp_path_factory):
    source = CHATML if request.param == "chatml" else RICH
    directory = tmp_path_factory.mktemp(request.param)
    if request.param.endswith("sentencepiece"):
        _sentencepiece_gguf(directory / "t.gguf", chat_template=source)
    else:
        vocab = byte_level_vocab(" ".join(m["content"] for c in CONVERSATIONS for m in c) * 3, num_merges=40)
        write_gguf(directory / "t.gguf", lambda w: write_gguf_tokenizer(w, vocab, chat_template=source))
    ours = Tokenizer.load(directory / "t.gguf")
    theirs = transformers.AutoTokenizer.from_pretrained(directory, gguf_file="t.gguf")
    return ours, theirs


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_rendering_and_ids_match_transformers(template_pair, conversation, add_generation_prompt):
    ours, theirs = template_pair
    messages = CONVERSATIONS[conversation]
    text = ChatTemplate(ours.chat_template, ours.special_tokens).render(messages, add_generation_prompt)
    assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False)
    assert ours.encode(text, add_special_tokens=False) == ids


def test_template_errors_are_reported():
    with pytest.raises(ChatTemplateError, match="Unknown role: tool"):
        ChatTemplate(RICH, {"eos_token": "</s>"}).render([{"role": "tool", "content": "x"}])


def test_templates_run_sandboxed():
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        ChatTemplate(escape).render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")
