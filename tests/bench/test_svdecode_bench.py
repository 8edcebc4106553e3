"""``bench svdecode``'s accuracy check: a def line naming the reference function counts, with
the uncased word-piece decoding's spacing undone; anything else does not."""
from rankwise_bench.svdecode import def_line_correct


def test_def_line_correct_names_the_function():
    assert def_line_correct("def _ get _ name ( self ) :", "def _get_name(self):")
    assert def_line_correct("async def Foo ( x ) :", "async def foo(x):")
    assert not def_line_correct("def foo(x):", "def bar(x):")
    assert not def_line_correct("def foo", "def foo(x):")          # no argument list: not a def line
    assert not def_line_correct("return foo(x)", "def foo(x):")
