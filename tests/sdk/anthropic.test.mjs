// The official `@anthropic-ai/sdk` client against a running `deepinfer serve` (DEEPINFER_URL): Messages,
// streaming and not, with the same text either way.
import assert from 'node:assert/strict';
import { test } from 'node:test';
import Anthropic from '@anthropic-ai/sdk';

const client = new Anthropic({
  baseURL: process.env.DEEPINFER_URL ?? 'http://127.0.0.1:8000',
  apiKey: process.env.DEEPINFER_API_KEY ?? 'unused',
  maxRetries: 0,
});
const model = process.env.DEEPINFER_MODEL ?? 'demo';

test('messages, non-streaming and streaming agree', async () => {
  const request = {
    model, max_tokens: 8, temperature: 0, system: 'Be brief.',
    messages: [{ role: 'user', content: 'Hello!' }],
  };
  const message = await client.messages.create(request);
  assert.equal(message.type, 'message');
  assert.equal(message.role, 'assistant');
  assert.ok(['end_turn', 'max_tokens', 'stop_sequence'].includes(message.stop_reason));
  const text = message.content.filter((b) => b.type === 'text').map((b) => b.text).join('');
  assert.ok(message.usage.input_tokens > 0);
  assert.ok(message.usage.output_tokens >= 1 && message.usage.output_tokens <= 8);

  const stream = client.messages.stream(request);
  let streamed = '';
  stream.on('text', (delta) => { streamed += delta; });
  const final = await stream.finalMessage();
  assert.equal(streamed, text);
  assert.equal(final.stop_reason, message.stop_reason);
  assert.deepEqual(final.usage.output_tokens, message.usage.output_tokens);
});

test('an invalid request surfaces as the SDK error', async () => {
  await assert.rejects(
    client.messages.create({ model, max_tokens: 8, messages: [] }),
    (error) => error instanceof Anthropic.APIError && error.status === 400,
  );
});
