// The official `openai` npm client against a running `deepinfer serve` (DEEPINFER_URL, default
// http://127.0.0.1:8000) on the built-in demo model: chat and completions, streaming and not, logprobs,
// and an error surfacing as the SDK's APIError.
import assert from 'node:assert/strict';
import { test } from 'node:test';
import OpenAI from 'openai';

const baseURL = (process.env.DEEPINFER_URL ?? 'http://127.0.0.1:8000') + '/v1';
const client = new OpenAI({ baseURL, apiKey: process.env.DEEPINFER_API_KEY ?? 'unused', maxRetries: 0 });
const model = process.env.DEEPINFER_MODEL ?? 'demo';

test('models lists the served model', async () => {
  const models = await client.models.list();
  assert.ok(models.data.some((m) => m.id === model), JSON.stringify(models.data));
});

test('chat completion, non-streaming', async () => {
  const completion = await client.chat.completions.create({
    model,
    messages: [{ role: 'system', content: 'Be brief.' }, { role: 'user', content: 'Hello!' }],
    max_tokens: 8,
    temperature: 0,
  });
  const choice = completion.choices[0];
  assert.equal(choice.message.role, 'assistant');
  assert.equal(typeof choice.message.content, 'string');
  assert.ok(['stop', 'length'].includes(choice.finish_reason));
  assert.ok(completion.usage.prompt_tokens > 0);
  assert.ok(completion.usage.completion_tokens >= 1 && completion.usage.completion_tokens <= 8);
  assert.equal(completion.usage.total_tokens, completion.usage.prompt_tokens + completion.usage.completion_tokens);
});

test('chat completion, streaming with usage, equals the non-streaming answer', async () => {
  const request = { model, messages: [{ role: 'user', content: 'Count to five.' }], max_tokens: 8, temperature: 0 };
  const whole = await client.chat.completions.create(request);
  const stream = await client.chat.completions.create({ ...request, stream: true, stream_options: { include_usage: true } });
  let text = '';
  let usage = null;
  let finish = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const choice of chunk.choices) {
      text += choice.delta?.content ?? '';
      if (choice.finish_reason) finish = choice.finish_reason;
    }
  }
  assert.equal(text, whole.choices[0].message.content);
  assert.equal(finish, whole.choices[0].finish_reason);
  assert.deepEqual(usage, whole.usage);
});

test('chat completion with logprobs and a seed', async () => {
  const request = {
    model, messages: [{ role: 'user', content: 'Pick a word.' }], max_tokens: 4,
    temperature: 0.9, seed: 7, logprobs: true, top_logprobs: 3,
  };
  const a = await client.chat.completions.create(request);
  const b = await client.chat.completions.create(request);
  assert.equal(a.choices[0].message.content, b.choices[0].message.content, 'same seed, same text');
  const content = a.choices[0].logprobs.content;
  assert.ok(content.length >= 1);
  for (const entry of content) {
    assert.ok(entry.logprob <= 0);
    assert.equal(entry.top_logprobs.length, 3);
  }
});

test('completions, streaming and not', async () => {
  const whole = await client.completions.create({ model, prompt: 'The sky is', max_tokens: 6, temperature: 0, logprobs: 2 });
  assert.equal(typeof whole.choices[0].text, 'string');
  assert.ok(whole.choices[0].logprobs.tokens.length >= 1);
  const stream = await client.completions.create({ model, prompt: 'The sky is', max_tokens: 6, temperature: 0, stream: true });
  let text = '';
  for await (const chunk of stream) text += chunk.choices[0]?.text ?? '';
  assert.equal(text, whole.choices[0].text);
});

test('an invalid request surfaces as the SDK error with status and message', async () => {
  await assert.rejects(
    client.chat.completions.create({ model, messages: [{ role: 'user', content: 'hi' }], temperature: 7 }),
    (error) => {
      assert.ok(error instanceof OpenAI.APIError, String(error));
      assert.equal(error.status, 400);
      assert.match(error.message, /temperature/);
      return true;
    },
  );
  await assert.rejects(
    client.chat.completions.create({ model: 'no-such-model', messages: [{ role: 'user', content: 'hi' }] }),
    (error) => error instanceof OpenAI.NotFoundError,
  );
});
