// A smol.v1 client in another language: Create, Exec (streamed), Get, Destroy against smold.
// Usage: node client.js SOCKET_PATH GUEST_DIR   (prints one JSON document with what it saw)
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = path.resolve(__dirname, '..', '..', 'proto');

function load() {
  const def = protoLoader.loadSync('smol/v1/smol.proto', {
    includeDirs: [PROTO_ROOT],
    keepCase: true, // snake_case field names, as in the .proto
    longs: Number,
    enums: String,
    defaults: false,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(def).smol.v1;
}

function unary(client, method, request) {
  return new Promise((resolve, reject) => {
    client[method](request, (err, resp) => (err ? reject(err) : resolve(resp)));
  });
}

function execCollect(client, request) {
  return new Promise((resolve, reject) => {
    const out = { stdout: Buffer.alloc(0), stderr: Buffer.alloc(0), exit: null, events: [] };
    const call = client.Exec(request);
    call.on('data', (msg) => {
      out.events.push(msg.event);
      if (msg.event === 'stdout') out.stdout = Buffer.concat([out.stdout, msg.stdout]);
      else if (msg.event === 'stderr') out.stderr = Buffer.concat([out.stderr, msg.stderr]);
      else if (msg.event === 'exit') out.exit = msg.exit;
    });
    call.on('error', reject);
    call.on('end', () => resolve(out));
  });
}

function errorOf(promise) {
  return promise.then(
    () => null,
    (err) => ({ code: grpc.status[err.code], details: err.details }),
  );
}

async function main() {
  const [socketPath, guestDir] = process.argv.slice(2);
  const smol = load();
  const client = new smol.Smol(`unix:${socketPath}`, grpc.credentials.createInsecure());
  const report = {};

  const created = await unary(client, 'CreateMachine', {
    name: 'from-node',
    smolfile: {
      spec: {
        cpus: 1,
        memory_mib: 256,
        env: { LANGUAGE_OF_CLIENT: 'javascript' },
        checks: [{ file_exists: { path: `${guestDir}/from-node.txt` } }],
      },
    },
  });
  report.machine = created.machine;

  const ex = await execCollect(client, {
    machine_id: created.machine.id,
    argv: ['sh', '-c', `echo "hello from $LANGUAGE_OF_CLIENT"; printf '\\377' >&2; cat > ${guestDir}/from-node.txt; exit 5`],
    stdin: Buffer.from('written by node\n'),
  });
  report.exec = {
    stdout: ex.stdout.toString('utf8'),
    stderr_hex: ex.stderr.toString('hex'),
    exit: ex.exit,
    last_event: ex.events[ex.events.length - 1],
  };

  const verified = await unary(client, 'Verify', { machine_id: created.machine.id });
  report.verify = verified.result;

  await unary(client, 'DestroyMachine', { machine_id: created.machine.id });
  report.after_destroy = await errorOf(unary(client, 'GetMachine', { machine_id: created.machine.id }));
  report.bad_smolfile = await errorOf(unary(client, 'CreateMachine', {
    smolfile: { toml: { text: 'memory = 1', filename: 'node.toml' } },
  }));

  client.close();
  process.stdout.write(JSON.stringify(report) + '\n');
}

main().catch((err) => {
  process.stderr.write(`interop client failed: ${err && err.stack ? err.stack : err}\n`);
  process.exit(1);
});
