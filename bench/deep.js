// One phase of the deep-queue benchmark, one JSON line.
// usage: node bench/deep.js URL QUEUE fill COUNT [SIZE] [FIRST]
//        node bench/deep.js URL QUEUE drain COUNT [FIRST]
// fill: COUNT persistent messages of SIZE bytes (default 1024) numbered from FIRST (default
//   0) into the durable QUEUE, with confirms and at most 1,000 unconfirmed; waits for every
//   confirm.
// drain: consumes COUNT messages (prefetch 2,000, `multiple` acks every 500) and checks they
//   are numbered FIRST, FIRST+1, ... in order.
// Prints {phase, count, seconds, rate, bad}; exits non-zero on a nack, a gap or a duplicate.
'use strict';
const amqp = require('amqplib');

async function fill(ch, queue, count, size, first) {
  const body = Buffer.alloc(Math.max(size, 8), 'd');
  let outstanding = 0;
  let confirmed = 0;
  let bad = 0;
  let wake = null;
  let resolveAll;
  const all = new Promise((r) => { resolveAll = r; });
  const onConfirm = (err) => {
    if (err) bad++;
    outstanding--;
    if (++confirmed === count) resolveAll();
    if (wake) { const w = wake; wake = null; w(); }
  };
  for (let i = 0; i < count; i++) {
    while (outstanding >= 1000) await new Promise((r) => { wake = r; });
    const b = Buffer.from(body);
    b.writeUInt32BE(first + i, 0);
    outstanding++;
    if (!ch.publish('', queue, b, { persistent: true }, onConfirm)) {
      await new Promise((r) => ch.once('drain', r));
    }
  }
  if (count) await all;
  return bad;
}

async function drain(ch, queue, count, first) {
  await ch.prefetch(2000);
  let received = 0;
  let bad = 0;
  let unacked = 0;
  let resolveDone;
  const done = new Promise((r) => { resolveDone = r; });
  await ch.consume(queue, (msg) => {
    if (msg === null) return;
    if (msg.content.readUInt32BE(0) !== first + received) bad++;
    received++;
    if (++unacked === 500 || received === count) { ch.ack(msg, true); unacked = 0; }
    if (received === count) resolveDone();
  });
  await done;
  return bad;
}

async function main() {
  const [url, queue, phase, countArg, ...rest] = process.argv.slice(2);
  const count = Number(countArg);
  const conn = await amqp.connect(url);
  conn.on('error', (err) => { console.error(`connection error: ${err.message}`); process.exit(3); });
  const ch = phase === 'fill' ? await conn.createConfirmChannel() : await conn.createChannel();
  // RabbitMQ's classic queue version 2 (3.10 on) keeps a deep queue's messages on disk;
  // Tandem takes the argument and ignores it.
  await ch.assertQueue(queue, { durable: true, arguments: { 'x-queue-version': 2 } });
  const start = process.hrtime.bigint();
  const bad = phase === 'fill'
    ? await fill(ch, queue, count, Number(rest[0] || 1024), Number(rest[1] || 0))
    : await drain(ch, queue, count, Number(rest[0] || 0));
  const seconds = Number(process.hrtime.bigint() - start) / 1e9;
  // The channel first: amqplib sends each channel's frames through its own buffer, and
  // Connection.Close went out ahead of the last ack, which the broker then rightly
  // ignored (the queue kept its last 500 messages, and the log the segments behind them).
  await ch.close();
  await conn.close();
  console.log(JSON.stringify({ phase, count, seconds, rate: count / seconds, bad }));
  if (bad) process.exit(1);
}

main().catch((err) => { console.error(err); process.exit(2); });
