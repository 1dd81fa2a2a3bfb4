// The built-in demo model (trained on the deepseek-v4.1 format with thinking turns and DSML tool calls,
// tools/prepare_demo_data.py) through the official `openai` client: greedy, it calls the tool a request offers,
// streams its reasoning and the call's arguments as deltas, and answers from the tool's result. This is the
// transcript of the README, run against the real model (DEEPINFER_URL, as openai.test.mjs).
import assert from 'node:assert/strict';
import { test } from 'node:test';
import OpenAI from 'openai';

const baseURL = (process.env.DEEPINFER_URL ?? 'http://127.0.0.1:8000') + '/v1';
const client = new OpenAI({ baseURL, apiKey: process.env.DEEPINFER_API_KEY ?? 'unused', maxRetries: 0 });
const model = process.env.DEEPINFER_MODEL ?? 'demo';
const tools = [{
  type: 'function',
  function: {
    name: 'get_weather', description: 'Get the current weather in a city.',
    parameters: { type: 'object', properties: { city: { type: 'string', description: 'The city name' } }, required: ['city'] },
  },
}];

test('demo: a tool call with streamed reasoning, then an answer from the tool result', async () => {
  const messages = [{ role: 'user', content: 'What is the weather in Tokyo?' }];
  const stream = await client.chat.completions.create({
    model, messages, tools, temperature: 0, stream: true, chat_template_kwargs: { thinking: true } });
  let reasoning = '';
  let reasoningDeltas = 0;
  let argumentDeltas = 0;
  let finish;
  const calls = [];
  for await (const chunk of stream) {
    const choice = chunk.choices[0];
    if (!choice) continue;
    if (choice.delta.reasoning_content) { reasoning += choice.delta.reasoning_content; reasoningDeltas++; }
    assert.ok(!choice.delta.content, `no content before the call: ${JSON.stringify(choice.delta)}`);
    for (const tc of choice.delta.tool_calls ?? []) {
      calls[tc.index] ??= { id: tc.id, name: '', arguments: '' };
      calls[tc.index].name += tc.function?.name ?? '';
      if (tc.function?.arguments) { calls[tc.index].arguments += tc.function.arguments; argumentDeltas++; }
    }
    if (choice.finish_reason) finish = choice.finish_reason;
  }
  assert.equal(finish, 'tool_calls');
  assert.ok(reasoningDeltas >= 2 && reasoning.length > 0, `reasoning in deltas: ${reasoning}`);
  assert.equal(calls.length, 1);
  assert.equal(calls[0].name, 'get_weather');
  assert.ok(argumentDeltas >= 2, 'arguments arrive in several deltas');
  assert.deepEqual(JSON.parse(calls[0].arguments), { city: 'Tokyo' });

  messages.push({
    role: 'assistant', content: null, reasoning_content: reasoning,
    tool_calls: [{ id: calls[0].id, type: 'function', function: { name: 'get_weather', arguments: calls[0].arguments } }],
  });
  messages.push({ role: 'tool', tool_call_id: calls[0].id, content: '{"city": "Tokyo", "temperature": 12, "unit": "celsius", "sky": "rainy"}' });
  const answer = await client.chat.completions.create({
    model, messages, tools, temperature: 0, chat_template_kwargs: { thinking: true } });
  const choice = answer.choices[0];
  assert.equal(choice.finish_reason, 'stop');
  assert.ok(!choice.message.tool_calls?.length, JSON.stringify(choice.message));
  assert.ok(choice.message.content.includes('Tokyo'), choice.message.content);
});

test('demo: without thinking the call comes first, no reasoning', async () => {
  const completion = await client.chat.completions.create({
    model, tools, temperature: 0, messages: [{ role: 'user', content: 'What is the weather in Paris?' }] });
  const choice = completion.choices[0];
  assert.equal(choice.finish_reason, 'tool_calls');
  assert.ok(!choice.message.reasoning_content);
  assert.equal(choice.message.tool_calls[0].function.name, 'get_weather');
  assert.deepEqual(JSON.parse(choice.message.tool_calls[0].function.arguments), { city: 'Paris' });
});
