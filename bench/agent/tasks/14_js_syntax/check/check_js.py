from tree_sitter_language_pack import get_parser

with open("src/index.js", "rb") as f:
    source = f.read()
tree = get_parser("javascript").parse(source)
assert not tree.root_node.has_error, "syntax error remains"
assert b"item.price * item.quantity" in source and b"return sum" in source
