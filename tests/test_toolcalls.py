"""Lenient tool-call parsing: the shapes small models really emit."""

import json

import pytest

from codeplane.models.toolcalls import parse_tool_calls

ALLOWED = {"read_file", "grep"}


def args(call) -> dict:
    return json.loads(call.arguments)


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>',
    '<tool_call>{"name": "read_file", "arguments": {"path": "a.py"}}',  # unclosed at the end
    '```json\n{"name": "read_file", "arguments": {"path": "a.py"}}\n```',
    'Let me look.\n{"name": "read_file", "arguments": {"path": "a.py"}}',
    '{"name": "read_file", "parameters": {"path": "a.py"}}',
    '{"function": {"name": "read_file", "arguments": "{\\"path\\": \\"a.py\\"}"}}',
    "{'name': 'read_file', 'arguments': {'path': 'a.py'}}",
    '{{"name": "read_file", "arguments": {"path": "a.py"}}}',
])
def test_one_call_in_many_shapes(text):
    content, calls = parse_tool_calls(text, ALLOWED)
    assert [c.name for c in calls] == ["read_file"]
    assert args(calls[0]) == {"path": "a.py"}
    assert "read_file" not in content and "{" not in content


def test_several_calls_in_one_turn_become_several_tool_calls():
    text = ('<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "grep", "arguments": {"pattern": "def "}}\n</tool_call>')
    _, calls = parse_tool_calls(text, ALLOWED)
    assert [c.name for c in calls] == ["read_file", "grep"]
    assert len({c.id for c in calls}) == 2


def test_a_json_list_of_calls():
    text = ('```json\n[{"name": "read_file", "arguments": {"path": "a.py"}},'
            ' {"name": "grep", "arguments": {"pattern": "x"}}]\n```')
    _, calls = parse_tool_calls(text, ALLOWED)
    assert [c.name for c in calls] == ["read_file", "grep"]


def test_json_that_is_not_a_declared_tool_stays_content():
    text = 'The config is {"name": "deploy", "arguments": {}} and {"a": 1}.'
    content, calls = parse_tool_calls(text, ALLOWED)
    assert calls == [] and content == text


def test_prose_answer_has_no_calls():
    content, calls = parse_tool_calls("The answer is 42.", ALLOWED)
    assert calls == [] and content == "The answer is 42."
