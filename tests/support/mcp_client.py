"""The MCP SDK's own client against `rlm mcp` over stdio, for the tests that call our MCP tools."""

from __future__ import annotations

import os
import sys

import anyio
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from tests.support.workers import ROOT


def stdio_run(env: dict[str, str], script, *args: str):
    """``script(session)`` against a stdio server the SDK's client spawns; returns what it returns."""
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "rlm_api.cli_mcp", *args], env={**os.environ, **env}, cwd=str(ROOT)
    )

    async def main():
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            return await script(session)

    return anyio.run(main)
