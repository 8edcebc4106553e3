"""``rankwise.data.instruct:def_line_reward``, the stdlib-functions task reward: 1 exactly when a
completion parses as a ``def`` line naming the record's function (case- and word-piece-spacing
insensitive), from whichever column names the function."""
from __future__ import annotations

import pytest

from rankwise.data.instruct import def_line_reward, parsed_name


def test_the_reward_is_one_exactly_for_a_parsing_def_line_with_the_right_name():
    completions = ["def get_name(self) -> str:",            # the reference itself
                   "def get _ name ( self ) - > str :",     # MiniLM's decoding of it
                   "def GET_NAME(self, **kw):",             # uncased tokenizers lose the case
                   "async def get_name(self):",
                   "def get_nam(self):",                    # wrong name
                   "def get_name(self",                     # does not parse
                   "get_name(self)",                        # not a def line
                   "def get_name(self):\nprint(1)"]         # only the first line counts
    ids = ["json.decoder:get_name:10"] * len(completions)
    assert def_line_reward([""] * len(ids), completions, id=ids) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert def_line_reward(["", ""], ["def f(x):", "def g(x):"], completion=["def f(a, b):", "def f():"]) \
        == [1.0, 0.0]
    assert def_line_reward([""], ["def f(x):"], name=["f"], id=["m:g:1"]) == [1.0]   # name first
    assert parsed_name("def _ _ init _ _ ( self ) :") == "__init__"


def test_no_column_naming_the_function_is_refused():
    with pytest.raises(ValueError, match="pass the records' id, completion or name column"):
        def_line_reward(["p"], ["def f():"], other=["x"])
