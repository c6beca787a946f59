"""The light Markdown of a page's prose as HTML (reward_lens_spec.render.inline_html), written out
by hand: the first screen's target verdict is strong text that holds a code span, which the
renderer once left as literal asterisks on the HTML page while the Markdown page showed it bold."""

from reward_lens_spec.render import inline_html


def test_strong_around_a_code_span_is_strong():
    assert inline_html("**Your target `correct` fell.**") == "<strong>Your target <code>correct</code> fell.</strong>"


def test_nothing_inside_a_code_span_is_markup_and_everything_is_escaped():
    assert inline_html("`**a** <b>` and **<i>**") == "<code>**a** &lt;b&gt;</code> and <strong>&lt;i&gt;</strong>"


def test_emphasis_links_and_underscores():
    assert inline_html("*x `y`* [the `D_t` book](#cost) KL_min") == (
        '<em>x <code>y</code></em> <a href="#cost">the <code>D_t</code> book</a> KL_min')


def test_a_nul_in_the_text_cannot_forge_a_placeholder():
    assert inline_html("\x000\x00 `a`") == "0 <code>a</code>"
