#!/usr/bin/env node
'use strict';
// node generate.js --server HOST:PORT --prompt-ids 1,2,3 [--max-new-tokens N]
//                  [--cloud-only | --drafts blocks.json] [--temperature T --seed S]
//                  [--tls-ca ca.pem] [--token T (default $SPECSPLIT_TOKEN)]
// Prints one JSON object: token_ids, rounds, drafted, accepted, finish, target_forward_passes.
// blocks.json: {"blocks": [[d_1, ..., d_k], ...]}, sent one per round, in order.

const fs = require('node:fs');
const { parseArgs } = require('node:util');
const { connect, generate } = require('./specsplit');

async function main() {
  const { values: a } = parseArgs({
    options: {
      server: { type: 'string', default: '127.0.0.1:50051' },
      'prompt-ids': { type: 'string' },
      'max-new-tokens': { type: 'string', default: '32' },
      temperature: { type: 'string', default: '0' },
      seed: { type: 'string' },
      'cloud-only': { type: 'boolean', default: false },
      drafts: { type: 'string' },
      'tls-ca': { type: 'string' },
      token: { type: 'string', default: process.env.SPECSPLIT_TOKEN },
    },
  });
  if (!a['prompt-ids']) throw new Error('--prompt-ids is required (comma-separated token ids)');
  const drafts = a.drafts ? JSON.parse(fs.readFileSync(a.drafts, 'utf8')).blocks : [];
  const client = connect(a.server, { tlsCa: a['tls-ca'] });
  try {
    const out = await generate(client, {
      promptIds: a['prompt-ids'].split(',').map(Number),
      maxNewTokens: Number(a['max-new-tokens']),
      temperature: Number(a.temperature),
      seed: a.seed,
      cloudOnly: a['cloud-only'],
      drafts,
      token: a.token,
    });
    out.route = a['cloud-only'] ? 'cloud-only' : 'split';
    console.log(JSON.stringify(out));
  } finally {
    client.close();
  }
}

main().catch((e) => {
  console.error(`specsplit-node: ${e.message}`);
  process.exit(2);
});
