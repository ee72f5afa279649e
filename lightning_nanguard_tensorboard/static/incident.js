// Incident view: everything known about one event, from events.jsonl and its context files.

import {thumbnailUrl} from './api.js';
import {ACTION_TEXT, actionChip, blameText, causeChip, causeTitle, h, indicesMark, kindChips, mark, nameList, num,
  recordsOf, samplesByLoader} from './dom.js';

// details keys shown in their own sections (the rest go to "other details")
const SHOWN_DETAILS = new Set(['batch_size', 'hint', 'source_text', 'module_type', 'bn_channels', 'stack',
  'function', 'not_attributable', 'micro_batch', 'loader_batch_sizes', 'dataset_indices_unknown', 'sample_loaders_unknown',
  'indices_unverified', 'blame_unverified', 'verify_passes', 'blame_note']);

function section(title, ...body) {
  return h('section', {class: 'detail-section', dataset: {section: title}}, h('h4', {}, title), ...body);
}

function row(label, ...value) {
  return h('div', {class: 'kv'}, h('span', {class: 'k'}, label), h('span', {class: 'v'}, ...value));
}

function header(event) {
  const where = [`epoch ${event.epoch}`, `batch ${event.batch_idx}`, `rank ${event.rank ?? 0}`];
  if (event.details && event.details.micro_batch !== undefined) where.push(`micro-batch ${event.details.micro_batch}`);
  return h('div', {class: 'incident-head'},
      h('h3', {}, `Step ${event.global_step}`),
      h('span', {class: 'muted'}, where.join(' · ')),
      h('div', {class: 'chips'}, kindChips(event.kinds), causeChip(event.cause), actionChip(event.action)));
}

function actionSection(event) {
  const done = {
    skipped: 'The update was dropped: weights, optimizer state and BatchNorm statistics are as before the step.',
    rolled_back: 'The update was dropped and the last good state was restored.',
    warned: 'The update was applied (action="warn"); the event is only reported.',
    raised: 'Training was stopped with NonFiniteTrainingError.',
  }[event.action] || `action: ${event.action}`;
  const remedies = event.remedies || [];
  return section('Action',
      h('p', {}, h('strong', {}, ACTION_TEXT[event.action] || event.action || '?'), ' — ', done),
      event.cause ? h('p', {class: 'muted'}, `Cause: ${event.cause} (${causeTitle(event.cause)})`) : null,
      remedies.length ? h('ul', {class: 'remedies'}, remedies.map((r) => h('li', {}, r))) : h('p', {class: 'muted'}, 'No remedy applied.'));
}

// The dataset indices of the named samples at `places`: "dataset indices [7, 9]", "records per row [10, 11], [40]", or null.
function recordsAt(event, places) {
  if (event.sample_records) return `records per row ${places.map((i) => recordsOf(event.sample_records[i])).join(', ')}`;
  if (event.dataset_indices) return `dataset indices [${places.map((i) => event.dataset_indices[i]).join(', ')}]`;
  return null;
}

function samplesSection(run, index, event, context) {
  const details = event.details || {};
  const body = [];
  const marked = indicesMark(event);
  if (event.offending_samples && event.sample_loaders) {
    // several training loaders: each sample is a position in its own loader's part, an index in its loader's dataset
    const sizes = new Map((details.loader_batch_sizes || []).map(([key, size]) => [String(key), size]));
    for (const [key, places] of samplesByLoader(event)) {
      const of = sizes.has(String(key)) ? ` of ${sizes.get(String(key))}` : '';
      const positions = places.map((i) => event.offending_samples[i]);
      const indices = recordsAt(event, places) || 'dataset indices unknown';
      body.push(h('div', {class: 'kv loader', dataset: {loader: String(key)}}, h('span', {class: 'k'}, `loader ${key}`),
          h('span', {class: 'v'}, `positions [${positions.join(', ')}]${of} · ${indices}`)));
    }
    if (!event.dataset_indices && !event.sample_records && details.dataset_indices_unknown) {
      body.push(h('p', {class: 'muted small'}, `Dataset indices unknown: ${details.dataset_indices_unknown}`));
    }
    if (marked) body.push(h('div', {class: 'kv indices'}, h('span', {class: 'k'}, 'dataset indices'), h('span', {class: 'v'}, mark(marked, event.indices_verified))));
  } else if (event.offending_samples) {
    const of = details.batch_size !== undefined ? ` of ${details.batch_size}` : '';
    body.push(row('positions in the batch', `[${event.offending_samples.join(', ')}]${of}`));
    const verdict = marked ? [' ', mark(`(${marked})`, event.indices_verified)] : [];
    if (event.sample_records) {
      const rows = event.sample_records.map((records, i) => `#${event.offending_samples[i]}: ${recordsOf(records)}`);
      body.push(h('div', {class: 'kv records'}, h('span', {class: 'k'}, 'records per row'), h('span', {class: 'v'}, rows.join(' · '), verdict)));
    } else {
      body.push(h('div', {class: 'kv indices'}, h('span', {class: 'k'}, 'dataset indices'),
          h('span', {class: 'v'}, event.dataset_indices ? [`[${event.dataset_indices.join(', ')}]`, verdict] : 'unknown')));
    }
  } else if (event.cause === 'batch') {
    body.push(h('p', {}, 'The batch as a whole is at fault: no record is named, nothing is quarantined.'));
    if (details.not_attributable) body.push(h('p', {class: 'muted small'}, details.not_attributable));
  } else if (details.not_attributable) {
    body.push(h('p', {}, `Not attributable to individual samples: ${details.not_attributable}`));
  } else {
    body.push(h('p', {class: 'muted'}, 'The samples were not searched.'));
  }
  const blame = blameText(event);
  if (blame) body.push(h('div', {class: 'kv blame'}, h('span', {class: 'k'}, 'blame'), h('span', {class: 'v'}, mark(blame, event.blame_verified))));
  if (details.sample_loaders_unknown) body.push(h('p', {class: 'muted small'}, details.sample_loaders_unknown));
  const thumbs = (context && context.thumbnails) || [];
  if (thumbs.length) {
    body.push(h('div', {class: 'thumbs'}, thumbs.map((t) => h('figure', {class: 'thumb'},
        h('img', {src: thumbnailUrl(run, index, t.position), alt: `sample ${t.position}`, width: 96,
          height: Math.round(96 * t.height / t.width)}),
        h('figcaption', {},
            `#${t.position}` + (t.dataset_index !== null && t.dataset_index !== undefined ? ` · index ${t.dataset_index}` : '') +
              (t.records ? ` · records ${t.records.join(', ')}` : ''),
            h('br'), t.nonfinite_values ? `${t.nonfinite_values} NaN/Inf values` : 'all values finite')))));
    body.push(h('p', {class: 'muted small'}, 'NaN pixels magenta, Inf pixels orange.'));
  }
  for (const note of (context && context.notes) || []) {
    if (/image|sample/.test(note)) body.push(h('p', {class: 'muted small'}, note));
  }
  return section('Offending samples', ...body);
}

function originSection(event) {
  const details = event.details || {};
  if (event.culprit_op === null && event.culprit_module === null && !details.function) {
    return section('Origin', h('p', {class: 'muted'}, 'Not localised.'));
  }
  const module = event.culprit_module ? event.culprit_module : '<LightningModule>';
  return section('Origin',
      row('phase', event.phase || '?'),
      row('module', h('code', {}, module), details.module_type ? ` (${details.module_type})` : ''),
      row('op', h('code', {}, event.culprit_op || '?')),
      details.function ? row('function', h('code', {}, details.function)) : null);
}

function sourceSection(event, context) {
  const source = context && context.source;
  if (source && source.lines && source.lines.length) {
    const lines = source.lines.map((text, i) => {
      const number = source.first_line + i;
      return h('div', {class: number === source.line ? 'code-line culprit' : 'code-line'},
          h('span', {class: 'ln'}, String(number)), h('span', {class: 'code'}, text));
    });
    return section('Source', h('div', {class: 'file'}, `${source.file}:${source.line}`), h('pre', {class: 'source'}, lines));
  }
  if (event.source_line) {
    const text = event.details && event.details.source_text;
    return section('Source',
        h('div', {class: 'file'}, event.source_line),
        text ? h('pre', {class: 'source'}, h('div', {class: 'code-line culprit'}, h('span', {class: 'code'}, text))) : null,
        h('p', {class: 'muted small'}, 'The lines around it were not saved with this event.'));
  }
  return null;
}

function stackSection(event, context) {
  const frames = (context && context.stack && context.stack.length) ? context.stack : (event.details && event.details.stack) || [];
  if (!frames.length) return null;
  return section('Stack (innermost last)', h('ol', {class: 'stack'}, frames.map((f) => h('li', {},
      h('code', {class: 'fn'}, f.function || '?'), ' ', h('span', {class: 'muted'}, `${f.file}:${f.line}`),
      f.text ? h('pre', {class: 'frame-text'}, f.text) : null))));
}

function bnChannels(value) {
  if (value === null || value === undefined) return null;
  if (typeof value === 'string') return value;
  if (typeof value === 'object' && !Array.isArray(value)) {
    return Object.entries(value).map(([name, channels]) => h('div', {},
        h('code', {}, name), ': ', Array.isArray(channels) ? `channels [${channels.join(', ')}]` : JSON.stringify(channels)));
  }
  return JSON.stringify(value);
}

function tensorsSection(event) {
  const details = event.details || {};
  const rows = [row('loss', num(event.loss)), row('gradient norm', num(event.grad_norm))];
  if ((event.nonfinite_grads || []).length) rows.push(row(`parameter grads (${event.nonfinite_grads.length})`, nameList(event.nonfinite_grads)));
  if ((event.nonfinite_buffers || []).length) rows.push(row(`BatchNorm buffers (${event.nonfinite_buffers.length})`, nameList(event.nonfinite_buffers)));
  if ((event.nonfinite_params || []).length) rows.push(row(`parameters (${event.nonfinite_params.length})`, nameList(event.nonfinite_params)));
  if (details.bn_channels) rows.push(row('BatchNorm channels', bnChannels(details.bn_channels)));
  return section('Non-finite tensors', ...rows);
}

function otherDetails(event) {
  const details = event.details || {};
  const rest = Object.entries(details).filter(([key]) => !SHOWN_DETAILS.has(key));
  if (!rest.length) return null;
  return section('Other details', ...rest.map(([key, value]) => row(key,
      typeof value === 'object' && value !== null ? h('code', {}, JSON.stringify(value)) : num(value))));
}

function reproSection(bundle) {
  if (bundle.status === 'present') {
    return section('Repro', h('p', {class: 'muted small'}, 'Re-run the saved samples in a fresh process:'),
        h('pre', {class: 'command'}, bundle.command));
  }
  if (bundle.status === 'pruned') {
    return section('Repro', h('p', {class: 'pruned'}, 'bundle pruned'),
        h('p', {class: 'muted small'}, `${bundle.name} was deleted to keep the newest bundles (max_repro_bundles).`));
  }
  return section('Repro', h('p', {class: 'muted'}, 'No repro bundle was saved for this event.'));
}

/** The incident panel for the `incident` route's answer. */
function precursorSection(event) {
  const d = event.details || {};
  const rows = [
    row('module', h('code', {}, event.culprit_module || '?')),
    row('signal', `${(d.signal || '').replaceAll('_', ' ')} ${num(d.value)}`, d.threshold !== undefined ? ` (level ${num(d.threshold)})` : ''),
  ];
  if (d.growth !== undefined) rows.push(row('growth', `${num(d.growth)}x since step ${d.earlier_step} (${num(d.earlier_value)})`));
  if (d.entropy !== undefined) rows.push(row('attention entropy', `${num(d.entropy)} nats (min-entropy bound ${num(d.min_entropy)})`));
  const fixes = (d.fixes || []).map((fix) => h('li', {}, fix));
  return section('Early warning: attention collapse ahead', ...rows,
      h('p', {class: 'muted small'}, 'No NaN yet: the step was applied. The usual fixes:'), h('ul', {}, ...fixes));
}

/** A part of the guard itself failed: which, the error, where, what stops, whether the guard still guards. */
function guardErrorSection(event) {
  const d = event.details || {};
  const on = d.guard_on !== false;
  return section('The guard\'s own error',
      row('part', h('code', {}, d.part || '?')),
      row('error', h('code', {}, d.error || '?')),
      row('where', h('code', {}, d.where || '?')),
      row('stops', d.stops || ''),
      row('still guarded', on ? 'yes: NaN/Inf steps are still checked and dropped'
          : 'no: no later step is checked; restart the run to guard it again'),
      h('p', {class: 'muted small'}, 'Please report it with the traceback in the training log.'));
}

export function incidentView(run, data) {
  const {event, context, bundle} = data;
  const index = event._dashboard.index;
  const details = event.details || {};
  if ((event.kinds || []).includes('precursor')) {
    return h('article', {class: 'incident', dataset: {run, index}}, header(event), precursorSection(event));
  }
  if ((event.kinds || []).includes('guard_error')) {
    return h('article', {class: 'incident', dataset: {run, index}}, header(event), guardErrorSection(event));
  }
  return h('article', {class: 'incident', dataset: {run, index}},
      header(event),
      h('div', {class: 'incident-grid'},
          h('div', {class: 'col'}, actionSection(event), samplesSection(run, index, event, context)),
          h('div', {class: 'col'},
              originSection(event),
              details.hint ? section('Hint', h('p', {class: 'hint'}, details.hint)) : null,
              reproSection(bundle))),
      sourceSection(event, context),
      stackSection(event, context),
      h('div', {class: 'incident-grid'},
          h('div', {class: 'col'}, tensorsSection(event)),
          h('div', {class: 'col'}, otherDetails(event))));
}
