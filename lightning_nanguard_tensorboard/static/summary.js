// Run summary: one column per selected run.

import {h, kindGroup, mark, num} from './dom.js';

function bars(title, pairs, colourOf) {
  if (!pairs.length) return null;
  const most = Math.max(...pairs.map(([, n]) => n));
  return h('div', {class: 'bars', dataset: {section: title}}, h('h4', {}, title), pairs.map(([label, count]) =>
    h('div', {class: 'bar-row'},
        h('span', {class: 'bar-label'}, label),
        h('span', {class: 'bar-track'}, h('span', {class: `bar ${colourOf ? colourOf(label) : ''}`, style: {width: `${(100 * count) / most}%`}})),
        h('span', {class: 'bar-count'}, String(count)))));
}

function steps(list, count) {
  const more = count > list.length ? ', …' : '';
  return list.join(', ') + more;
}

function lostSteps(summary) {
  const parts = [`${summary.steps_skipped} step${summary.steps_skipped === 1 ? '' : 's'} skipped`];
  if (summary.skipped_total !== null && summary.skipped_total !== undefined && summary.skipped_total !== summary.steps_skipped) {
    parts.push(`${num(summary.skipped_total)} counted by nanguard/skipped_total (with other ranks' bad steps)`);
  }
  if (summary.rollbacks) parts.push(`${summary.rollbacks} rollback${summary.rollbacks === 1 ? '' : 's'}`);
  let of = '';
  if (summary.last_logged_step !== null && summary.last_logged_step !== undefined) {
    const total = summary.last_logged_step + 1;
    of = ` of ${total.toLocaleString('en-US')} steps (${((100 * summary.steps_skipped) / total).toFixed(1)}%)`;
  }
  return h('p', {class: 'lost'}, parts.join(' · ') + of);
}

// whether every incident naming an item verified its index and its blame (the quarantine's condition)
function verifiedCell(item) {
  if (item.verified === undefined || item.verified === null) return h('td', {class: 'verified muted'}, '—');
  return h('td', {class: 'verified'}, mark(item.verified ? 'verified' : 'not verified', item.verified));
}

function indexTable(summary, onIndex) {
  if (!summary.dataset_indices.length) return h('p', {class: 'muted'}, 'No dataset indices recorded.');
  const loaders = summary.dataset_indices.some((item) => item.loader !== undefined && item.loader !== null);
  const verified = summary.dataset_indices.some((item) => item.verified !== undefined && item.verified !== null);
  return h('table', {class: 'ranked'},
      h('thead', {}, h('tr', {}, loaders ? h('th', {}, 'loader') : null, h('th', {}, 'dataset index'),
          h('th', {class: 'num'}, 'incidents'), h('th', {}, 'steps'),
          verified ? h('th', {title: 'index and blame verified in every incident naming it'}, 'checked') : null)),
      h('tbody', {}, summary.dataset_indices.map((item) => h('tr', {},
          loaders ? h('td', {class: 'loader'}, item.loader === undefined || item.loader === null ? '—' : String(item.loader)) : null,
          h('td', {}, h('code', {}, String(item.index))),
          h('td', {class: 'num'}, String(item.count)),
          h('td', {class: 'muted'}, steps(item.steps, item.count)),
          verified ? verifiedCell(item) : null))));
}

function originTable(summary) {
  if (!summary.origins.length) return h('p', {class: 'muted'}, 'No origin localised.');
  return h('table', {class: 'ranked'},
      h('thead', {}, h('tr', {}, h('th', {}, 'source line'), h('th', {}, 'module · op'), h('th', {class: 'num'}, 'incidents'))),
      h('tbody', {}, summary.origins.map((o) => h('tr', {},
          h('td', {}, h('code', {}, o.source_line || '—')),
          h('td', {}, h('code', {}, o.module), ' · ', h('code', {}, o.function || o.op || '?'),
              o.phase ? h('span', {class: 'muted'}, ` (${o.phase})`) : null),
          h('td', {class: 'num'}, String(o.count))))));
}

function tiles(summary) {
  const tile = (value, label) => h('div', {class: 'tile'}, h('div', {class: 'tile-value'}, String(value)), h('div', {class: 'tile-label'}, label));
  return h('div', {class: 'tiles'},
      tile(summary.incidents, summary.incidents === 1 ? 'incident' : 'incidents'),
      tile(summary.steps_skipped, 'steps skipped'),
      tile(summary.dataset_indices_total, 'dataset items involved'),
      tile(summary.origins.length, summary.origins.length === 1 ? 'origin' : 'origins'));
}

/** The summary column of one run (the `summary` route's answer). */
export function summaryColumn(summary) {
  const range = summary.first_step === null ? 'no incidents' :
    `${summary.incidents} incident${summary.incidents === 1 ? '' : 's'}, steps ${summary.first_step}–${summary.last_step}`;
  const ranks = summary.ranks.length > 1 ? ` · ranks ${summary.ranks.map(([r, n]) => `${r} (${n})`).join(', ')}` : '';
  return h('section', {class: 'card summary-card', dataset: {run: summary.run}},
      h('div', {class: 'card-head'}, h('h3', {}, summary.run), h('span', {class: 'muted'}, range + ranks)),
      tiles(summary),
      h('h4', {}, 'Steps lost'), lostSteps(summary),
      bars('By kind', summary.by_kind, (kind) => `g-${kindGroup([kind])}`),
      bars('By cause', summary.by_cause, () => 'g-cause'),
      bars('By action', summary.by_action, () => 'g-neutral'),
      bars('Remedies applied', summary.remedies, () => 'g-remedy'),
      h('h4', {}, 'Dataset indices, most often involved'),
      indexTable(summary),
      summary.dataset_indices_total > summary.dataset_indices.length ?
        h('p', {class: 'muted small'}, `${summary.dataset_indices_total} distinct indices in all`) : null,
      h('h4', {}, 'Origins, by count'),
      originTable(summary));
}
