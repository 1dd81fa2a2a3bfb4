// Tool calls and reasoning through the official `openai` and `@anthropic-ai/sdk` clients, for the
// deepseek-v3.1 and deepseek-v4.1 prompt formats. Random weights never write that markup, so these run
// against build/tests/scripted/scripted_server: the real server and output parser over a test-only engine
// double that emits the exact text a DeepSeek model writes in each format, chosen by a "script:NAME"
// marker in the prompt (see tests/scripted/scripted_server.cpp). URLs: DEEPINFER_SCRIPTED_URL_V31 and
// DEEPINFER_SCRIPTED_URL_V41 (tests/sdk/run.sh starts both servers); each format is skipped when unset.
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import OpenAI from 'openai';
import Anthropic from '@anthropic-ai/sdk';

const model = 'default';
const REASONING = 'The user wants the weather in Paris. I should call get_weather.';
const openaiTools = [{
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'Current weather of a city',
    parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] },
  },
}];
const anthropicTools = [{
  name: 'get_weather',
  description: 'Current weather of a city',
  input_schema: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] },
}];
const ask = 'What is the weather in Paris? script:tool_call';

for (const [format, variable] of [['deepseek-v3.1', 'DEEPINFER_SCRIPTED_URL_V31'], ['deepseek-v4.1', 'DEEPINFER_SCRIPTED_URL_V41']]) {
  const url = process.env[variable];
  const skip = url ? false : `${variable} is not set (start build/tests/scripted/scripted_server --chat-format ${format}; tests/sdk/run.sh does)`;
  describe(`tool calls and reasoning, ${format}`, { skip }, () => {
    const openai = new OpenAI({ baseURL: `${url}/v1`, apiKey: 'unused', maxRetries: 0 });
    const anthropic = new Anthropic({ baseURL: url, apiKey: 'unused', maxRetries: 0 });
    const chatRequest = {
      model, messages: [{ role: 'user', content: ask }], tools: openaiTools,
      chat_template_kwargs: { thinking: true },
    };
    const messagesRequest = {
      model, max_tokens: 1500, messages: [{ role: 'user', content: ask }], tools: anthropicTools,
      thinking: { type: 'enabled', budget_tokens: 1024 },
    };

    test('openai: non-streaming reasoning_content and tool_calls', async () => {
      const completion = await openai.chat.completions.create(chatRequest);
      const choice = completion.choices[0];
      assert.equal(choice.finish_reason, 'tool_calls');
      assert.equal(choice.message.reasoning_content, REASONING);
      assert.ok(!choice.message.content, `no content, got ${JSON.stringify(choice.message.content)}`);
      assert.equal(choice.message.tool_calls.length, 1);
      const call = choice.message.tool_calls[0];
      assert.equal(call.type, 'function');
      assert.equal(typeof call.id, 'string');
      assert.ok(call.id.length > 0);
      assert.equal(call.function.name, 'get_weather');
      assert.deepEqual(JSON.parse(call.function.arguments), { city: 'Paris' });
    });

    test('openai: plain reasoning and content', async () => {
      const completion = await openai.chat.completions.create({
        model, messages: [{ role: 'user', content: 'Think about it. script:reasoning' }],
        chat_template_kwargs: { thinking: true },
      });
      const choice = completion.choices[0];
      assert.equal(choice.finish_reason, 'stop');
      assert.equal(choice.message.reasoning_content, REASONING);
      assert.equal(choice.message.content, 'The answer is 42.');
      assert.ok(!choice.message.tool_calls?.length);
    });

    test('openai: streaming reasoning and tool_call deltas', async () => {
      const whole = await openai.chat.completions.create(chatRequest);
      const stream = await openai.chat.completions.create({ ...chatRequest, stream: true, stream_options: { include_usage: true } });
      let reasoning = '';
      let reasoningDeltas = 0;
      let content = '';
      let finish = null;
      let usage = null;
      const calls = new Map();  // index -> {id, name, args, names}
      for await (const chunk of stream) {
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices) {
          const delta = choice.delta ?? {};
          if (delta.reasoning_content) { reasoning += delta.reasoning_content; reasoningDeltas++; }
          content += delta.content ?? '';
          for (const tc of delta.tool_calls ?? []) {
            assert.equal(typeof tc.index, 'number');
            if (!calls.has(tc.index)) {
              // The first delta of a call carries its id, type and name.
              assert.ok(tc.id, 'first tool_call delta has an id');
              assert.equal(tc.function?.name, 'get_weather');
              calls.set(tc.index, { id: tc.id, name: tc.function.name, args: '', names: 1 });
            } else {
              const call = calls.get(tc.index);
              assert.ok(!tc.id || tc.id === call.id, 'the id is not repeated differently');
              if (tc.function?.name) call.names++;
            }
            calls.get(tc.index).args += tc.function?.arguments ?? '';
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
      assert.equal(finish, 'tool_calls');
      assert.equal(reasoning, REASONING);
      assert.ok(reasoningDeltas >= 2, `reasoning arrives in several deltas, got ${reasoningDeltas}`);
      assert.equal(content, '');
      assert.deepEqual([...calls.keys()], [0]);
      const call = calls.get(0);
      assert.equal(call.names, 1, 'the name is sent once');
      assert.deepEqual(JSON.parse(call.args), { city: 'Paris' });
      assert.equal(call.args, whole.choices[0].message.tool_calls[0].function.arguments);
      assert.deepEqual(usage, whole.usage);
    });

    test('openai: a follow-up with the tool result is accepted', async () => {
      const first = await openai.chat.completions.create(chatRequest);
      const message = first.choices[0].message;
      const call = message.tool_calls[0];
      const completion = await openai.chat.completions.create({
        model, tools: openaiTools, chat_template_kwargs: { thinking: true },
        messages: [
          { role: 'user', content: ask },
          { role: 'assistant', content: message.content, reasoning_content: message.reasoning_content, tool_calls: message.tool_calls },
          { role: 'tool', tool_call_id: call.id, content: '{"temperature": 22, "sky": "sunny", "note": "script:final"}' },
        ],
      });
      const choice = completion.choices[0];
      assert.equal(choice.finish_reason, 'stop');
      assert.equal(choice.message.content, 'It is 22 degrees and sunny in Paris.');
      assert.ok(!choice.message.tool_calls?.length);
    });

    test('anthropic: non-streaming thinking then tool_use', async () => {
      const message = await anthropic.messages.create(messagesRequest);
      assert.equal(message.stop_reason, 'tool_use');
      assert.deepEqual(message.content.map((b) => b.type), ['thinking', 'tool_use']);
      assert.equal(message.content[0].thinking, REASONING);
      const use = message.content[1];
      assert.equal(use.name, 'get_weather');
      assert.ok(use.id);
      assert.deepEqual(use.input, { city: 'Paris' });
    });

    test('anthropic: streaming thinking_delta and input_json_delta', async () => {
      const stream = anthropic.messages.stream(messagesRequest);
      let thinking = '';
      let json = '';
      const starts = [];
      for await (const event of stream) {
        if (event.type === 'content_block_start') starts.push(event.content_block.type);
        if (event.type === 'content_block_delta' && event.delta.type === 'thinking_delta') thinking += event.delta.thinking;
        if (event.type === 'content_block_delta' && event.delta.type === 'input_json_delta') json += event.delta.partial_json;
      }
      const final = await stream.finalMessage();
      assert.deepEqual(starts, ['thinking', 'tool_use']);
      assert.equal(thinking, REASONING);
      assert.deepEqual(JSON.parse(json), { city: 'Paris' });
      assert.equal(final.stop_reason, 'tool_use');
      assert.deepEqual(final.content.map((b) => b.type), ['thinking', 'tool_use']);
      assert.equal(final.content[1].name, 'get_weather');
      assert.deepEqual(final.content[1].input, { city: 'Paris' });
    });

    test('anthropic: a follow-up with the tool_result is accepted', async () => {
      const first = await anthropic.messages.create(messagesRequest);
      const use = first.content.find((b) => b.type === 'tool_use');
      const message = await anthropic.messages.create({
        ...messagesRequest,
        messages: [
          { role: 'user', content: ask },
          { role: 'assistant', content: first.content },
          { role: 'user', content: [{ type: 'tool_result', tool_use_id: use.id, content: '{"temperature": 22, "sky": "sunny", "note": "script:final"}' }] },
        ],
      });
      assert.equal(message.stop_reason, 'end_turn');
      const text = message.content.filter((b) => b.type === 'text').map((b) => b.text).join('');
      assert.equal(text, 'It is 22 degrees and sunny in Paris.');
    });
  });
}
