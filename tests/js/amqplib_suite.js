// Scenarios through amqplib (Node.js). usage: node tests/js/amqplib_suite.js URL
// Exits 0 when every scenario passed; prints each scenario's name and result.
'use strict';
const assert = require('node:assert/strict');
const amqp = require('amqplib');

const url = process.argv[2];
const scenarios = [];
const scenario = (name, fn) => scenarios.push([name, fn]);

scenario('confirm channel, durable queue, consume and ack in order', async (conn) => {
  const ch = await conn.createConfirmChannel();
  const q = 'js-confirm';
  await ch.assertQueue(q, { durable: true });
  for (let i = 0; i < 100; i++) ch.sendToQueue(q, Buffer.from(String(i)), { persistent: true });
  await ch.waitForConfirms();
  const got = [];
  await new Promise((resolve) => {
    ch.consume(q, (msg) => {
      got.push(Number(msg.content.toString()));
      ch.ack(msg);
      if (got.length === 100) resolve();
    });
  });
  assert.deepEqual(got, [...Array(100).keys()]);
  await ch.close();
});

scenario('topic routing and get', async (conn) => {
  const ch = await conn.createChannel();
  await ch.assertExchange('js-topic', 'topic', { durable: false });
  const { queue } = await ch.assertQueue('', { exclusive: true });
  await ch.bindQueue(queue, 'js-topic', 'stock.#');
  ch.publish('js-topic', 'stock.nyse.ibm', Buffer.from('ibm'));
  ch.publish('js-topic', 'bond.x', Buffer.from('bond'));
  await ch.checkQueue(queue);
  const m = await ch.get(queue, { noAck: true });
  assert.equal(m.content.toString(), 'ibm');
  assert.equal(m.fields.routingKey, 'stock.nyse.ibm');
  assert.equal(await ch.get(queue, { noAck: true }), false);
  await ch.close();
});

scenario('nack to dead-letter exchange with x-death', async (conn) => {
  const ch = await conn.createChannel();
  await ch.assertExchange('js-dlx', 'fanout');
  await ch.assertQueue('js-dead');
  await ch.bindQueue('js-dead', 'js-dlx', '');
  await ch.assertQueue('js-work', { deadLetterExchange: 'js-dlx' });
  ch.sendToQueue('js-work', Buffer.from('bad'));
  const m = await ch.get('js-work');
  ch.nack(m, false, false);
  await ch.checkQueue('js-dead');
  const d = await ch.get('js-dead', { noAck: true });
  assert.equal(d.content.toString(), 'bad');
  assert.equal(d.properties.headers['x-death'][0].reason, 'rejected');
  await ch.close();
});

scenario('prefetch limits deliveries until acks', async (conn) => {
  const ch = await conn.createChannel();
  await ch.assertQueue('js-prefetch');
  for (let i = 0; i < 10; i++) ch.sendToQueue('js-prefetch', Buffer.from('x'));
  await ch.prefetch(4);
  const held = [];
  await ch.consume('js-prefetch', (msg) => held.push(msg));
  // A round trip: every delivery the broker sent before its reply has been handled.
  await ch.checkQueue('js-prefetch');
  assert.equal(held.length, 4);
  ch.ack(held[3], true);
  await ch.checkQueue('js-prefetch');
  assert.equal(held.length, 8);
  await ch.close();
});

scenario('channel error leaves the connection usable', async (conn) => {
  const ch = await conn.createChannel();
  ch.on('error', () => {});
  await assert.rejects(ch.checkQueue('js-does-not-exist'), /404/);
  const ch2 = await conn.createChannel();
  await ch2.assertQueue('js-after-error');
  await ch2.close();
});

scenario('consumer cancel notification', async (conn) => {
  const ch = await conn.createChannel();
  await ch.assertQueue('js-cancel');
  const cancelled = new Promise((resolve) => {
    ch.consume('js-cancel', (msg) => { if (msg === null) resolve(true); });
  });
  const other = await conn.createChannel();
  await other.deleteQueue('js-cancel');
  assert.equal(await cancelled, true);
  await ch.close();
  await other.close();
});

scenario('direct reply-to RPC', async (conn) => {
  const server = await conn.createChannel();
  await server.assertQueue('js-rpc');
  await server.consume('js-rpc', (msg) => {
    server.sendToQueue(msg.properties.replyTo, Buffer.from(msg.content.toString().toUpperCase()),
      { correlationId: msg.properties.correlationId });
    server.ack(msg);
  });
  const client = await conn.createChannel();
  const reply = new Promise((resolve) => {
    client.consume('amq.rabbitmq.reply-to', (msg) => resolve(msg), { noAck: true });
  });
  await new Promise((r) => setImmediate(r));
  client.sendToQueue('js-rpc', Buffer.from('ping'),
    { replyTo: 'amq.rabbitmq.reply-to', correlationId: 'abc' });
  const msg = await reply;
  assert.equal(msg.content.toString(), 'PING');
  assert.equal(msg.properties.correlationId, 'abc');
});

async function main() {
  let failed = 0;
  for (const [name, fn] of scenarios) {
    const conn = await amqp.connect(url);
    conn.on('error', () => {});
    try {
      await fn(conn);
      console.log(`ok - ${name}`);
    } catch (err) {
      failed++;
      console.log(`not ok - ${name}: ${err && err.stack}`);
    }
    await conn.close().catch(() => {});
  }
  console.log(`${scenarios.length - failed} passed, ${failed} failed`);
  process.exit(failed ? 1 : 0);
}

main().catch((err) => { console.error(err); process.exit(2); });
