"""A small MCP server for examples/mcp_tool: a shop's stock and prices, as two tools.

Built with the official MCP SDK (`mcp.server.mcpserver.MCPServer`); any MCP server works the same way.
Run it on stdio (what task.yaml does: vcpo starts it) or as a streamable HTTP server that vcpo reaches
by URL (task_http.yaml):

    python examples/mcp_tool/server.py                  # stdio
    python examples/mcp_tool/server.py --http 8765      # http://127.0.0.1:8765/mcp
"""

from __future__ import annotations

import argparse

from mcp.server.mcpserver import MCPServer

STOCK = {"pen": 12, "notebook": 5, "lamp": 3, "mug": 8}
PRICE = {"pen": 1.5, "notebook": 4.0, "lamp": 18.0, "mug": 6.5}

app = MCPServer("shop")


def _known(item: str) -> str:
    if item not in STOCK:  # the model sees this message as the tool's error
        raise ValueError(f"unknown item {item!r}; the shop sells: {', '.join(STOCK)}")
    return item


@app.tool()
def stock(item: str) -> int:
    """Units of an item in stock (pen, notebook, lamp or mug)."""
    return STOCK[_known(item)]


@app.tool()
def price(item: str) -> float:
    """Price of one unit of an item, in euros."""
    return PRICE[_known(item)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on 127.0.0.1:PORT")
    args = parser.parse_args()
    if args.http is None:
        app.run()
    else:
        app.run("streamable-http", host="127.0.0.1", port=args.http)


if __name__ == "__main__":
    main()
