"""The benchmarks' printed tables: headers take their column's alignment and width, cells their format."""

from server.tables import format_table


def test_headers_and_cells_share_each_columns_alignment_and_width():
    text = format_table([{"mode": "plain", "tok_s": 12.345, "n": 3}, {"mode": "drafted", "tok_s": 101.0, "n": 16}],
                        [("mode", "mode", "<8"), ("tok/s", "tok_s", ">9.1f"), ("batch", "n", ">5")])
    assert text.splitlines() == ["mode         tok/s batch",
                                 "plain         12.3     3",
                                 "drafted      101.0    16"]


def test_a_missing_or_none_value_prints_as_a_dash_in_its_column():
    text = format_table([{"a": None}, {}], [("a", "a", ">6.2f"), ("b", "b", "<3")])
    assert text.splitlines()[1:] == ["     - -  ", "     - -  "]


def test_no_rows_gives_the_header_alone():
    assert format_table([], [("x", "x", "^5")]) == "  x  "
