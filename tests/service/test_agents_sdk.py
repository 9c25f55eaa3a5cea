"""The OpenAI Agents SDK (pinned in the test extra) runs an agent with a function tool to its end against a real
``dgserve serve`` process on the shipped small model, with the SDK's default model API: the Responses API.

The small model's free text rarely ends before a token limit, so the agent stops on its first tool call
(``tool_use_behavior="stop_on_first_tool"``, one of the SDK's own behaviours) and ``tool_choice: "required"``
makes it call; what the full loop does on this model is in docs/responses-api.md ("Clients")."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest
from storm import ServerProcess

from dgserve.model.default_model import default_model_path

agents = pytest.importorskip("agents", reason="the OpenAI Agents SDK is in the test extra")
CITIES = ("Paris", "London", "Tokyo")


@pytest.fixture(scope="module")
def url():
    server = ServerProcess(default_model_path())
    yield f"http://127.0.0.1:{server.http_port}/v1"
    server.kill()


def test_an_agent_calls_its_function_tool_and_finishes(url):
    from openai import AsyncOpenAI

    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "London", "Tokyo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    async def run(seed: int):
        client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        try:
            model = agents.OpenAIProvider(openai_client=client).get_model("tiny")  # the default: Responses
            agent = agents.Agent(
                name="weather",
                instructions="Answer with the weather tool.",
                tools=[get_weather],
                model=model,
                tool_use_behavior="stop_on_first_tool",
                model_settings=agents.ModelSettings(
                    tool_choice="required", parallel_tool_calls=False, max_tokens=128, extra_body={"seed": seed}
                ),
            )
            return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3)
        finally:
            await client.close()

    agents.set_tracing_disabled(True)
    for seed in (1, 2):
        calls.clear()
        result = asyncio.run(run(seed))
        assert type(result.raw_responses[0].response_id) is str and result.raw_responses[0].response_id.startswith(
            "resp_"
        )  # it spoke the Responses API
        assert len(calls) == 1 and calls[0] in CITIES
        assert result.final_output == f"It is sunny in {calls[0]}."
        kinds = [type(item).__name__ for item in result.new_items]
        assert kinds == ["ToolCallItem", "ToolCallOutputItem"], kinds
